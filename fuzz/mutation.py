"""Mutation testing of the C core: plant one known bug at a time, rebuild, run the suite.

Each mutant below is a one-line change a plausible slip would make (a copy-on-write copy
skipped, a release one block short, a stale row reused, an eviction order inverted, a check
dropped). A mutant the suite does not fail on ("survived") marks a class of bugs the tests
cannot see: write the test that kills it, then ask which other bugs of that class it would
miss. The list is checked by ``tests/test_mutation_list.py`` so that it cannot rot: every
mutant's text must occur exactly once in its file.

    python fuzz/mutation.py --list                 # the mutants
    python fuzz/mutation.py [NAME ...]              # run them (all by default)
        [--tests tests] [--timeout 900] [--json FILE]

Each run copies the tracked tree into a temporary folder, applies one mutant, builds the
extension in place (about a minute) and runs ``pytest -x`` there (stopping at the first
failure: a killed mutant usually fails in seconds, a survivor runs the whole suite). A
build that fails counts as killed (the compiler caught it); pytest's own failures (usage
error, nothing collected, interrupted) count as an error, neither killed nor survived. Results are printed as they come
and, with ``--json``, saved.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Mutant(NamedTuple):
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in path
    new: str
    why: str  # the slip it stands for


MUTANTS: List[Mutant] = [
    Mutant("cow-no-copy", "csrc/table.c",
           "if (off_in(m, s->ntokens)) tbl_queue_copy(m, b, nb);",
           "if (0) tbl_queue_copy(m, b, nb);",
           "copy-on-write of a shared partial block forgets to copy its content"),
    Mutant("need-no-cow", "csrc/table.c",
           "users(m, r->blocks[w]) > 1 ? add_sat(grow, 1) : grow;",
           "grow;",
           "the block count of an append misses the copy-on-write block"),
    Mutant("release-short", "csrc/table.c",
           "for (int32_t j = r->lo; j < upto; j++) {",
           "for (int32_t j = r->lo; j < upto - 1; j++) {",
           "a window group releases one block too few"),
    Mutant("dead-copies-kept", "csrc/table.c",
           "if (p->ref_count[dst] == 0) {",
           "if (0) {",
           "a pending copy into a released block survives (the drain hazard class)"),
    Mutant("twins-inverted", "csrc/policy.c",
           "if (kvb_cache_find(p, &twin) == KVB_NONE) break;",
           "if (kvb_cache_find(p, &twin) != KVB_NONE) break;",
           "the groups' second chance goes to the wrong blocks"),
    Mutant("meta-stale-kv", "csrc/meta.c",
           "same_kv = r[3] == k ? r[2] : 0;",
           "same_kv = r[2];",
           "a reused metadata buffer keeps a page-list row whose offset moved"),
    Mutant("meta-no-pad", "csrc/meta.c",
           "if (!same_bt) /* a row",
           "if (0) /* a row",
           "a block-table row written anew keeps the previous row's tail"),
    Mutant("batch-never-tight", "csrc/append.c",
           "if (KVB_UNLIKELY(need > p->num_free)) { /* count exactly",
           "if (0) { /* count exactly",
           "a decode step never counts exactly when the pool is nearly full"),
    Mutant("fork-no-ref", "csrc/manager.c",
           "for (int64_t i = r->lo; i < nb; i++) p->ref_count[r->blocks[i]]++;",
           "for (int64_t i = r->lo + 1; i < nb; i++) p->ref_count[r->blocks[i]]++;",
           "fork shares a block without a reference"),
    Mutant("plan-no-release", "kvblocks/_step.pxi",
           "        kvb_step_release(mgr.gp, mgr.ng, sl, q, B)\n        if commit:",
           "        if commit:",
           "a planned step leaves the release of what its queries cannot read to its commit"),
    Mutant("egap-unchecked", "csrc/table.h",
           "if (s->ntokens - q > r->done) {",
           "if (0) {",
           "a step with uncomputed tokens before its query is accepted"),
    Mutant("lru-to-head", "csrc/pool.c",
           "        list_push_tail(p, b);\n        p->num_evictable++;",
           "        list_push_head(p, b);\n        p->num_evictable++;",
           "a released cached block is evicted first instead of last"),
    Mutant("hitlo-one-more", "csrc/table.h",
           "return lo < k - 1 ? lo : k - 1;",
           "return lo < k - 1 ? lo + (lo > 0) : k - 1;",
           "a window hit holds one block fewer than its next query reads"),
    Mutant("hh-trail-host-ignored", "csrc/hosthits.c",
           "trail = dv[i] == KVB_NONE && hv[i] == KVB_NONE ? 0 : trail + 1;",
           "trail = dv[i] == KVB_NONE ? 0 : trail + 1;",
           "a grouped host hit ignores the blocks only the host holds"),
    Mutant("onload-no-trade", "csrc/tier.c",
           "        if (!(p->flags[r->blocks[i]] & KVB_F_NOT_ONLOAD)) continue;",
           "        continue;",
           "an onload lands in a block a swap pair of the same drain reads"),
    Mutant("tier-match-no-flush", "csrc/tier.c",
           "    kvb_tier_flush(t); /* a prefix evicted a moment ago is on the host now */",
           "    (void)0;",
           "a host lookup misses the blocks evicted since the last flush"),
    Mutant("hh-no-flush", "csrc/hosthits.c",
           "    kvb_tier_flush(t); /* a prefix evicted a moment ago is on the host now */",
           "    (void)0;",
           "a grouped host lookup misses the blocks evicted since the last flush"),
    Mutant("cache-shift-no-wrap", "csrc/cache.c",
           "int stays = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);",
           "int stays = home > i && home <= j;",
           "the hash table's backward-shift deletion forgets that the probe run wraps around"),
    Mutant("rows-pad-null", "csrc/rows.c",
           "for (int64_t b = nb; b < out->max_blocks; b++) row[b] = (int32_t)first;",
           "for (int64_t b = nb; b < out->max_blocks; b++) row[b] = 0;",
           "row block tables pad with page 0 instead of the null block's page at the offset"),
    Mutant("rows-no-draft-writes", "csrc/rows.c",
           "int64_t start = L - qlens[i] - (drafts ? drafts[i] : 0);",
           "int64_t start = L - qlens[i];",
           "a step's write rows leave out its draft slots"),
    Mutant("free-head-reversed", "csrc/pool.c",
           "    } else if (where == KVB_PLACE_HEAD) {\n        for (int64_t i = n - 1; i >= 0; i--) {",
           "    } else if (where == KVB_PLACE_HEAD) {\n        for (int64_t i = 0; i < n; i++) {",
           "an evict-first free puts the batch at the head in reverse order"),
    Mutant("free-vllm-reversed", "csrc/pool.c",
           "for (int64_t i = n - 1; i >= 0; i--) { /* the uncached, a batch in front */",
           "for (int64_t i = 0; i < n; i++) { /* the uncached, a batch in front */",
           "free(order='vllm') puts the uncached batch at the head in reverse order"),
    Mutant("dup-first-drops-chain", "csrc/cache.c",
           "        else p->table[table_slot(p, e)] = dn[e]; /* same key: same probe run */",
           "        else table_remove(p, e);",
           "removing a key's first block loses its duplicates from lookups"),
    Mutant("secondary-kept-on-evict", "csrc/cache.c",
           "    if (KVB_UNLIKELY(p->xhead != NULL) && p->xhead[b] != KVB_NONE) drop_secondaries(p, b);",
           "    (void)0;",
           "a block's secondary keys outlive its entry (eviction, uncache): stale hits"),
    Mutant("secondary-not-moved", "csrc/cache.c",
           "    if (KVB_UNLIKELY(p->xhead != NULL) && p->xhead[src] != KVB_NONE) move_secondaries(p, src, dst);",
           "    (void)0;",
           "move_entry moves the primary key only, the secondaries stay on an uncached block"),
    Mutant("secondary-full-check-primary", "kvblocks/_pool.pxi",
           "                if self.p.nx:  # the hit may be a secondary key: its own 32 bytes",
           "                if False:",
           "lookup_bytes checks a hit through a secondary key against the block's own hash"),
    Mutant("dup-append-first", "csrc/cache.c",
           "            while (dn[c] != KVB_NONE) c = dn[c];\n            dn[c] = b;\n            dn[b] = KVB_NONE;",
           "            dn[b] = dn[c];\n            dn[c] = b;",
           "a duplicate joins its key's chain second, not last (lookups no longer earliest)"),
    Mutant("move-evictable-kept", "csrc/pool.c",
           "    if (p->flags[src] & KVB_F_FREE) p->num_evictable--; /* src stays listed, never-cached */",
           "    (void)0;",
           "a free block whose entry moved away is still counted evictable"),
    Mutant("try-reset-cached-only", "csrc/pool.c",
           "    if (p->num_free != p->num_blocks - 1) return 0; /* a block is in use: vLLM's False */",
           "    if (p->num_cached != p->num_evictable) return 0;",
           "the non-raising reset refuses only for held cached blocks, not vLLM's any block"),
    Mutant("uncache-evictable-kept", "csrc/pool.c",
           "        if (p->flags[b] & KVB_F_FREE) p->num_evictable--;",
           "        (void)0;",
           "a free block that loses its entry is still counted evictable"),
]  # fmt: skip


def check(mutants: List[Mutant], root: Path = ROOT) -> List[str]:
    """Problems with the list against the tree at root: each text must occur exactly once."""
    bad = []
    for m in mutants:
        n = (root / m.path).read_text().count(m.old)
        if n != 1:
            bad.append(f"{m.name}: its text occurs {n} times in {m.path}")
    names = [m.name for m in mutants]
    bad += [f"{n}: named twice" for n in set(names) if names.count(n) > 1]
    return bad


def _tree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for f in files:
        if f:
            src = ROOT / f.decode()
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f.decode())


def run_one(m: Mutant, tests: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as d:
        tree = Path(d)
        _tree(tree)
        p = tree / m.path
        p.write_text(p.read_text().replace(m.old, m.new))
        t0 = time.time()
        b = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        if b.returncode:
            return {"name": m.name, "result": "killed", "by": "build", "seconds": 0}
        env = dict(os.environ, PYTHONPATH=str(tree))
        try:
            # test_mutation_list.py fails on any applied mutant (its text is gone): not a kill
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
            cmd += [tests, "--ignore=tests/test_mutation_list.py"]
            r = subprocess.run(
                cmd,
                cwd=tree,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            rc, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            rc, out = -1, "timeout"
        secs = round(time.time() - t0)
        if rc == 0:
            return {"name": m.name, "result": "SURVIVED", "by": "", "seconds": secs}
        if rc in (2, 3, 4, 5):  # pytest interrupted, internal or usage error, nothing collected
            return {"name": m.name, "result": "error", "by": f"pytest exit {rc}", "seconds": secs}
        first = re.search(r"^(FAILED|ERROR) (\S+)", out, re.M)
        by = first.group(2) if first else ("timeout" if rc == -1 else f"exit {rc} (a crash)")
        return {"name": m.name, "result": "killed", "by": by, "seconds": secs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="mutation testing of the C core")
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--tests", default="tests", help="pytest target (default: tests)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per suite run")
    ap.add_argument("--json", default=None, help="save the results here")
    a = ap.parse_args(argv)
    bad = check(MUTANTS)
    if bad:
        print("mutation list out of date:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:24s} {m.path:16s} {m.why}")
        return 0
    known = {m.name: m for m in MUTANTS}
    if not (ROOT / a.tests.split("::", 1)[0]).exists():
        print(f"--tests {a.tests}: no such file or folder in {ROOT}", file=sys.stderr)
        return 2
    unknown = [n for n in a.names if n not in known]
    if unknown:
        print(f"unknown mutants: {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    results = []
    for m in [known[n] for n in a.names] or MUTANTS:
        r = run_one(m, a.tests, a.timeout)
        results.append(r)
        print(f"{r['name']:24s} {r['result']:8s} {r['by']} ({r['seconds']} s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    survived = [r["name"] for r in results if r["result"] == "SURVIVED"]
    errors = [r["name"] for r in results if r["result"] == "error"]
    killed = len(results) - len(survived) - len(errors)
    print(
        f"{killed} of {len(results)} killed"
        + (f"; survived: {', '.join(survived)}" if survived else "")
        + (f"; the suite could not run on: {', '.join(errors)}" if errors else "")
    )
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
