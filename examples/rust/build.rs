// Link libkvblocks: KVBLOCKS_LIB_DIR (an absolute path: a CMake build or install dir), else
// pkg-config's libdir (PKG_CONFIG_PATH finds kvblocks.pc).
use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=KVBLOCKS_LIB_DIR");
    let dir = env::var("KVBLOCKS_LIB_DIR").ok().or_else(|| {
        let out = Command::new("pkg-config")
            .args(["--variable=libdir", "kvblocks"])
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
    });
    if let Some(d) = dir {
        println!("cargo:rustc-link-search=native={d}");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{d}");
    }
    println!("cargo:rustc-link-lib=dylib=kvblocks");
}
