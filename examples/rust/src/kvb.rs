//! A small hand-written binding of libkvblocks (include/kvblocks.h): the `extern "C"`
//! declarations and `#[repr(C)]` structs the toy engine uses, and a safe `Manager` owning a
//! `kvb_manager_t` that turns error codes into `Error` (code, detail, the library's name).
//! Only the standard library: no crates (bindgen, libc) are needed.
#![allow(non_camel_case_types, dead_code)]

use std::ffi::CStr;
use std::fmt;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;

pub const KVB_OK: c_int = 0;
pub const KVB_EOUTOFBLOCKS: c_int = -2;
pub const KVB_EPENDING: c_int = -10;
pub const KVBLOCKS_ABI_VERSION: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct kvb_hash_t {
    pub lo: u64,
    pub hi: u64,
}

#[repr(C)]
pub struct kvb_pool_t {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvb_manager_t {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
pub struct kvb_cache_stats_t {
    pub queries: u64,
    pub query_blocks: u64,
    pub hit_blocks: u64,
    pub query_tokens: u64,
    pub hit_tokens: u64,
    pub recompute_query_tokens: u64,
    pub recompute_hit_tokens: u64,
    pub evictions: u64,
    pub allocations: u64,
    pub frees: u64,
    pub stored: u64,
}

#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
pub struct kvb_event_t {
    pub kind: i32,
    pub block: i32,
    pub hash: kvb_hash_t,
    pub parent: kvb_hash_t,
    pub group: i32,
    pub tag: i32,
    pub tok_off: i64,
    pub ntok: i64,
}

#[repr(C)]
pub struct kvb_group_spec_t {
    pub kind: i32,
    pub span: i64,
}

#[repr(C)]
pub struct kvb_manager_config_t {
    pub size: usize,
    pub num_blocks: i32,
    pub block_size: i32,
    pub num_host_blocks: i32,
    pub prefix_caching: i32,
    pub kv_events: i32,
    pub host_prefix_cache: i32,
    pub host_write_through: i32,
    pub hash_mode: i32,
    pub has_hash_key: i32,
    pub hash_key: [u8; 16],
    pub hash_seed: *const u8,
    pub hash_seed_len: usize,
    pub num_groups: i32,
    pub groups: *const kvb_group_spec_t,
}

#[repr(C)]
pub struct kvb_metadata_t {
    pub size: usize,
    pub slot_mapping: *mut i64,
    pub block_tables: *mut i32,
    pub seq_lens: *mut i32,
    pub qo_indptr: *mut i32,
    pub kv_indptr: *mut i32,
    pub kv_indices: *mut i32,
    pub kv_last_page_len: *mut i32,
    pub cap_tokens: i64,
    pub cap_indices: i64,
    pub max_blocks: i32,
    pub n_tokens: i64,
    pub n_indices: i64,
}

extern "C" {
    pub fn kvb_version(major: *mut c_int, minor: *mut c_int, patch: *mut c_int) -> c_int;
    pub fn kvb_version_string() -> *const c_char;
    pub fn kvb_strerror(code: c_int) -> *const c_char;
    pub fn kvb_pool_stats(p: *const kvb_pool_t, out: *mut kvb_cache_stats_t) -> c_int;
    pub fn kvb_pool_take_events(
        p: *mut kvb_pool_t,
        out: *mut kvb_event_t,
        cap: i64,
        tokens: *mut i32,
        tok_cap: i64,
        n_events: *mut i64,
        n_tokens: *mut i64,
    ) -> c_int;
    pub fn kvb_pool_pending_events(
        p: *mut kvb_pool_t,
        n_events: *mut i64,
        n_tokens: *mut i64,
    ) -> c_int;
    pub fn kvb_manager_config_init(c: *mut kvb_manager_config_t);
    pub fn kvb_manager_new(c: *const kvb_manager_config_t, out: *mut *mut kvb_manager_t) -> c_int;
    pub fn kvb_manager_delete(m: *mut kvb_manager_t);
    pub fn kvb_manager_pool(m: *mut kvb_manager_t) -> *mut kvb_pool_t;
    pub fn kvb_manager_add(
        m: *mut kvb_manager_t,
        tokens: *const i32,
        n: i64,
        salt: *const u8,
        salt_len: usize,
        recompute: c_int,
        seq_out: *mut i32,
        cached_out: *mut i64,
    ) -> c_int;
    pub fn kvb_manager_append(
        m: *mut kvb_manager_t,
        seq: i32,
        tokens: *const i32,
        n: i64,
        computed: c_int,
    ) -> c_int;
    pub fn kvb_manager_append_batch(
        m: *mut kvb_manager_t,
        seqs: *const i32,
        tokens: *const i32,
        n: i64,
    ) -> c_int;
    pub fn kvb_manager_reserve(m: *mut kvb_manager_t, seq: i32, n: i64) -> c_int;
    pub fn kvb_manager_truncate(m: *mut kvb_manager_t, seq: i32, ntokens: i64) -> c_int;
    pub fn kvb_manager_fork(m: *mut kvb_manager_t, parent: i32, child_out: *mut i32) -> c_int;
    pub fn kvb_manager_free(m: *mut kvb_manager_t, seq: i32) -> c_int;
    pub fn kvb_manager_swap_out(
        m: *mut kvb_manager_t,
        seq: i32,
        pairs: *mut i64,
        cap: i64,
        npairs: *mut i64,
    ) -> c_int;
    pub fn kvb_manager_swap_in(
        m: *mut kvb_manager_t,
        seq: i32,
        pairs: *mut i64,
        cap: i64,
        npairs: *mut i64,
    ) -> c_int;
    pub fn kvb_manager_swap_pairs_max(m: *const kvb_manager_t, seq: i32) -> i64;
    pub fn kvb_manager_num_tokens(m: *const kvb_manager_t, seq: i32) -> i64;
    pub fn kvb_manager_num_computed(m: *const kvb_manager_t, seq: i32) -> i64;
    pub fn kvb_manager_block_table(
        m: *const kvb_manager_t,
        group: i32,
        seq: i32,
        out: *mut i32,
        cap: i64,
        n: *mut i64,
    ) -> c_int;
    pub fn kvb_manager_metadata(
        m: *mut kvb_manager_t,
        group: i32,
        seqs: *const i32,
        qlens: *const i32,
        drafts: *const i32,
        b: i64,
        out: *mut kvb_metadata_t,
    ) -> c_int;
    pub fn kvb_manager_is_swapped(m: *const kvb_manager_t, seq: i32) -> c_int;
    pub fn kvb_manager_schedule(
        m: *mut kvb_manager_t,
        seqs: *const i32,
        qlens: *const i32,
        drafts: *const i32,
        b: i64,
    ) -> c_int;
    pub fn kvb_manager_pending_copies(m: *mut kvb_manager_t) -> i64;
    pub fn kvb_manager_take_copies(
        m: *mut kvb_manager_t,
        out: *mut i64,
        cap: i64,
        n: *mut i64,
    ) -> c_int;
    pub fn kvb_manager_check(m: *mut kvb_manager_t) -> c_int;
    pub fn kvb_manager_last_error(
        m: *const kvb_manager_t,
        a: *mut i64,
        b: *mut i64,
    ) -> *const c_char;
}

/// An error code of the library with the handle's detail.
#[derive(Debug, Clone)]
pub struct Error {
    pub code: c_int,
    pub a: i64,
    pub b: i64,
    pub what: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "{} (code {}, a={}, b={}",
            strerror(self.code),
            self.code,
            self.a,
            self.b
        )?;
        if !self.what.is_empty() {
            write!(f, ", {}", self.what)?;
        }
        write!(f, ")")
    }
}

pub fn strerror(code: c_int) -> String {
    unsafe { CStr::from_ptr(kvb_strerror(code)) }
        .to_string_lossy()
        .into_owned()
}

pub fn version() -> (c_int, String) {
    let abi = unsafe { kvb_version(ptr::null_mut(), ptr::null_mut(), ptr::null_mut()) };
    let s = unsafe { CStr::from_ptr(kvb_version_string()) };
    (abi, s.to_string_lossy().into_owned())
}

/// Owns one manager; every method maps a nonzero code to `Err`. Not `Sync`: one thread at a
/// time, as the header's thread rules say (`Send` is fine: no thread-local state).
pub struct Manager {
    m: *mut kvb_manager_t,
}

unsafe impl Send for Manager {}

pub struct Config {
    pub num_blocks: i32,
    pub block_size: i32,
    pub num_host_blocks: i32,
    pub kv_events: bool,
}

impl Manager {
    pub fn new(c: &Config) -> Result<Manager, Error> {
        let mut cfg: kvb_manager_config_t = unsafe { std::mem::zeroed() };
        unsafe { kvb_manager_config_init(&mut cfg) };
        assert_eq!(
            cfg.size,
            std::mem::size_of::<kvb_manager_config_t>(),
            "binding out of date"
        );
        cfg.num_blocks = c.num_blocks;
        cfg.block_size = c.block_size;
        cfg.num_host_blocks = c.num_host_blocks;
        cfg.kv_events = c.kv_events as i32;
        let mut m = ptr::null_mut();
        let rc = unsafe { kvb_manager_new(&cfg, &mut m) };
        if rc != KVB_OK {
            return Err(Error {
                code: rc,
                a: 0,
                b: 0,
                what: "kvb_manager_new".into(),
            });
        }
        Ok(Manager { m })
    }

    fn check(&self, rc: c_int) -> Result<(), Error> {
        if rc == KVB_OK {
            return Ok(());
        }
        let (mut a, mut b) = (0i64, 0i64);
        let w = unsafe { kvb_manager_last_error(self.m, &mut a, &mut b) };
        let what = if w.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(w) }.to_string_lossy().into_owned()
        };
        Err(Error {
            code: rc,
            a,
            b,
            what,
        })
    }

    /// Add a prompt: (sequence, cached tokens).
    pub fn add(&mut self, tokens: &[i32], recompute: bool) -> Result<(i32, i64), Error> {
        let (mut seq, mut cached) = (0i32, 0i64);
        let rc = unsafe {
            kvb_manager_add(
                self.m,
                tokens.as_ptr(),
                tokens.len() as i64,
                ptr::null(),
                0,
                recompute as c_int,
                &mut seq,
                &mut cached,
            )
        };
        self.check(rc).map(|_| (seq, cached))
    }

    pub fn append(&mut self, seq: i32, tokens: &[i32], computed: bool) -> Result<(), Error> {
        let rc = unsafe {
            kvb_manager_append(
                self.m,
                seq,
                tokens.as_ptr(),
                tokens.len() as i64,
                computed as c_int,
            )
        };
        self.check(rc)
    }

    pub fn append_batch(&mut self, seqs: &[i32], tokens: &[i32]) -> Result<(), Error> {
        if seqs.len() != tokens.len() {
            return Err(Error {
                code: -3,
                a: 0,
                b: 0,
                what: "lengths differ".into(),
            });
        }
        let rc = unsafe {
            kvb_manager_append_batch(self.m, seqs.as_ptr(), tokens.as_ptr(), seqs.len() as i64)
        };
        self.check(rc)
    }

    pub fn reserve(&mut self, seq: i32, n: i64) -> Result<(), Error> {
        let rc = unsafe { kvb_manager_reserve(self.m, seq, n) };
        self.check(rc)
    }

    pub fn truncate(&mut self, seq: i32, ntokens: i64) -> Result<(), Error> {
        let rc = unsafe { kvb_manager_truncate(self.m, seq, ntokens) };
        self.check(rc)
    }

    pub fn fork(&mut self, parent: i32) -> Result<i32, Error> {
        let mut child = 0i32;
        let rc = unsafe { kvb_manager_fork(self.m, parent, &mut child) };
        self.check(rc).map(|_| child)
    }

    pub fn free(&mut self, seq: i32) -> Result<(), Error> {
        let rc = unsafe { kvb_manager_free(self.m, seq) };
        self.check(rc)
    }

    fn pairs(&mut self, seq: i32, swap_in: bool) -> Result<Vec<(i64, i64)>, Error> {
        // an unknown sequence sizes nothing: the swap call itself refuses it, in its order
        let max = unsafe { kvb_manager_swap_pairs_max(self.m, seq) }.max(0);
        let mut buf = vec![0i64; 2 * max.max(1) as usize];
        let mut n = 0i64;
        let rc = unsafe {
            if swap_in {
                kvb_manager_swap_in(self.m, seq, buf.as_mut_ptr(), max, &mut n)
            } else {
                kvb_manager_swap_out(self.m, seq, buf.as_mut_ptr(), max, &mut n)
            }
        };
        self.check(rc)?;
        Ok((0..n as usize)
            .map(|i| (buf[2 * i], buf[2 * i + 1]))
            .collect())
    }

    /// (device, host) block pairs to copy.
    pub fn swap_out(&mut self, seq: i32) -> Result<Vec<(i64, i64)>, Error> {
        self.pairs(seq, false)
    }

    /// (host, device) block pairs to copy.
    pub fn swap_in(&mut self, seq: i32) -> Result<Vec<(i64, i64)>, Error> {
        self.pairs(seq, true)
    }

    pub fn num_tokens(&self, seq: i32) -> i64 {
        unsafe { kvb_manager_num_tokens(self.m, seq) }
    }

    pub fn num_computed(&self, seq: i32) -> i64 {
        unsafe { kvb_manager_num_computed(self.m, seq) }
    }

    pub fn block_table(&self, seq: i32) -> Result<Vec<i32>, Error> {
        let mut out = vec![0i32; 256];
        let mut n = 0i64;
        let rc = unsafe {
            kvb_manager_block_table(self.m, 0, seq, out.as_mut_ptr(), out.len() as i64, &mut n)
        };
        self.check(rc)?;
        out.truncate(n as usize);
        Ok(out)
    }

    /// The step's slot mapping (one slot per query token and draft slot, sequence by
    /// sequence) and query offsets; declares the step.
    pub fn metadata(
        &mut self,
        seqs: &[i32],
        qlens: &[i32],
        drafts: &[i32],
    ) -> Result<(Vec<i64>, Vec<i32>), Error> {
        let b = seqs.len();
        let ntok: i64 = qlens
            .iter()
            .zip(drafts)
            .map(|(q, d)| (*q + *d) as i64)
            .sum();
        let mut slot_mapping = vec![0i64; ntok.max(1) as usize];
        let (mut seq_lens, mut last) = (vec![0i32; b.max(1)], vec![0i32; b.max(1)]);
        let (mut qo, mut kvp) = (vec![0i32; b + 1], vec![0i32; b + 1]);
        let mut kvi = vec![0i32; 64 * b.max(1)];
        let mut md = kvb_metadata_t {
            size: std::mem::size_of::<kvb_metadata_t>(),
            slot_mapping: slot_mapping.as_mut_ptr(),
            block_tables: ptr::null_mut(),
            seq_lens: seq_lens.as_mut_ptr(),
            qo_indptr: qo.as_mut_ptr(),
            kv_indptr: kvp.as_mut_ptr(),
            kv_indices: kvi.as_mut_ptr(),
            kv_last_page_len: last.as_mut_ptr(),
            cap_tokens: slot_mapping.len() as i64,
            cap_indices: kvi.len() as i64,
            max_blocks: 0,
            n_tokens: 0,
            n_indices: 0,
        };
        let rc = unsafe {
            kvb_manager_metadata(
                self.m,
                0,
                seqs.as_ptr(),
                qlens.as_ptr(),
                drafts.as_ptr(),
                b as i64,
                &mut md,
            )
        };
        self.check(rc)?;
        assert_eq!(md.n_tokens, ntok, "metadata: query tokens");
        slot_mapping.truncate(ntok as usize);
        Ok((slot_mapping, qo))
    }

    /// Pending copy-on-write (src, dst) pairs, drained.
    pub fn take_copies(&mut self) -> Result<Vec<(i64, i64)>, Error> {
        let n = unsafe { kvb_manager_pending_copies(self.m) };
        let mut buf = vec![0i64; 2 * n.max(1) as usize];
        let mut got = 0i64;
        let rc = unsafe { kvb_manager_take_copies(self.m, buf.as_mut_ptr(), n, &mut got) };
        self.check(rc)?;
        Ok((0..got as usize)
            .map(|i| (buf[2 * i], buf[2 * i + 1]))
            .collect())
    }

    /// Declare a step without building metadata (no draft slots).
    pub fn schedule(&mut self, seqs: &[i32], qlens: &[i32]) -> Result<(), Error> {
        if seqs.len() != qlens.len() {
            return Err(Error {
                code: -3,
                a: 0,
                b: 0,
                what: "lengths differ".into(),
            });
        }
        let rc = unsafe {
            kvb_manager_schedule(
                self.m,
                seqs.as_ptr(),
                qlens.as_ptr(),
                ptr::null(),
                seqs.len() as i64,
            )
        };
        self.check(rc)
    }

    pub fn raw(&self) -> *const kvb_manager_t {
        self.m
    }

    pub fn raw_mut(&mut self) -> *mut kvb_manager_t {
        self.m
    }

    pub fn check_invariants(&mut self) -> Result<(), Error> {
        let rc = unsafe { kvb_manager_check(self.m) };
        self.check(rc)
    }

    /// Drain the device pool's events: how many.
    pub fn take_events(&mut self) -> Result<usize, Error> {
        let p = unsafe { kvb_manager_pool(self.m) };
        let (mut ne, mut nt) = (0i64, 0i64);
        unsafe { kvb_pool_pending_events(p, &mut ne, &mut nt) };
        let mut ev = vec![kvb_event_t::default(); ne.max(1) as usize];
        let mut tok = vec![0i32; nt.max(1) as usize];
        let rc = unsafe {
            kvb_pool_take_events(
                p,
                ev.as_mut_ptr(),
                ne,
                tok.as_mut_ptr(),
                nt,
                &mut ne,
                &mut nt,
            )
        };
        self.check(rc).map(|_| ne as usize)
    }

    pub fn stats(&mut self) -> kvb_cache_stats_t {
        let mut s = kvb_cache_stats_t::default();
        unsafe { kvb_pool_stats(kvb_manager_pool(self.m), &mut s) };
        s
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        unsafe { kvb_manager_delete(self.m) };
        self.m = ptr::null_mut::<c_void>() as *mut kvb_manager_t;
    }
}
