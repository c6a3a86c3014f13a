#!/usr/bin/env bash
# abi/check.sh -- libkvblocks' ABI against the checked-in baseline (abi/libkvblocks.so.1.abi,
# abidw XML from Debian's abigail-tools; docs/c-api.md, "Stability").
#
#   abi/check.sh [LIB]      compare LIB (default: a fresh RelWithDebInfo build) with the
#                           baseline of the same SONAME; exit 1 on an incompatible change
#   abi/check.sh --update   write the baseline of the current build (after a deliberate
#                           change: a new function, or a bump of KVBLOCKS_ABI_VERSION)
#
# An incompatible change (a function or type changed or removed) fails unless the ABI version
# was bumped (KVBLOCKS_ABI_VERSION in include/kvblocks.h, so the SONAME libkvblocks.so.N);
# then the baseline of the new SONAME must be written with --update. Compatible changes
# (functions added) pass with a note: add the baseline with --update in the same commit.
# The types are read from DWARF: the library is built with -g (RelWithDebInfo) and only the
# types of include/kvblocks.h count (--headers-dir, so the core's private structs may change).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
abi=$(sed -n 's/^#define KVBLOCKS_ABI_VERSION \([0-9]*\).*/\1/p' include/kvblocks.h)
baseline="abi/libkvblocks.so.$abi.abi"
update=0
lib=""
case "${1:-}" in
    --update) update=1 ;;
    "") ;;
    *) lib=$1 ;;
esac
if [ -z "$lib" ]; then
    cmake -S . -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVBLOCKS_EXAMPLES=OFF \
        > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
    cmake --build "$work/build" -j "$(nproc 2>/dev/null || echo 2)" --target kvblocks \
        > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
    lib="$work/build/libkvblocks.so"
fi
# (readelf's output is read whole: `grep -q` on a pipe can stop it early, and pipefail fails)
if ! readelf -S "$lib" | grep -c '\.debug_info' > /dev/null; then
    echo "abi/check.sh: $lib has no debug info (build with -g: RelWithDebInfo or Debug)"
    exit 1
fi
soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
if [ "$soname" != "libkvblocks.so.$abi" ]; then
    echo "abi/check.sh: $lib has SONAME $soname, the header says ABI $abi"
    exit 1
fi
abidw --headers-dir include --drop-private-types --no-corpus-path --no-comp-dir-path \
    --out-file "$work/new.abi" "$lib"
sed -i "s|$(pwd)/||g" "$work/new.abi" # paths relative to the tree: a baseline from any checkout
if [ "$update" = 1 ]; then
    cp "$work/new.abi" "$baseline"
    echo "abi/check.sh: wrote $baseline"
    exit 0
fi
if [ ! -f "$baseline" ]; then
    old=$(find abi -name 'libkvblocks.so.*.abi' | sort -V | tail -1)
    if [ -n "$old" ]; then
        echo "abi/check.sh: ABI version bumped to $abi (SONAME $soname; last baseline $old):"
        echo "incompatible changes are allowed; write the new baseline with abi/check.sh --update"
        abidiff "$old" "$work/new.abi" || true
        exit 0
    fi
    echo "abi/check.sh: no baseline for ABI $abi: abi/check.sh --update"
    exit 1
fi
set +e
abidiff --no-added-syms "$baseline" "$work/new.abi" > "$work/diff" 2>&1
rc=$?
abidiff "$baseline" "$work/new.abi" > "$work/full" 2>&1
set -e
if [ "$rc" -ne 0 ]; then  # a change or removal of what the baseline has (additions ignored)
    cat "$work/diff"
    echo "abi/check.sh: INCOMPATIBLE change to $soname (abidiff exit $rc): revert it, or bump"
    echo "KVBLOCKS_ABI_VERSION in include/kvblocks.h and write that baseline (--update)"
    exit 1
fi
if grep -q '[1-9][0-9]* Added' "$work/full"; then
    cat "$work/full"
    echo "abi/check.sh: compatible additions: list new functions in a new version node of"
    echo "cmake/libkvblocks.map (KVBLOCKS_1.1 ...) and update the baseline (--update)"
fi
echo "abi/check.sh: $soname is compatible with $baseline"
