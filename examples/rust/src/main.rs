//! A toy inference engine over libkvblocks, in Rust through a hand-written `extern "C"`
//! binding (kvb.rs; standard library only). The same engine as examples/c/toy_engine.c:
//! continuous batching with prefix reuse, parallel sampling by fork, swapping to a host pool,
//! preemption by recompute, speculative decoding with draft slots and rollback by truncate,
//! over a byte-array K/V store whose bytes for token p are a hash of the tokens 0..p. After
//! every step each sequence's K/V is read back through its block table and compared with
//! what its own tokens give; the manager's invariants are checked.
//!
//!   toy_engine [steps] [seed]     exit 0 and a summary line when every read-back matched
//!   toy_engine --replay < ops     op sequences, one observation line each (replay.rs)

mod kvb;
mod replay;

use std::process::exit;

const BS: usize = 4;
const NBLOCKS: usize = 40;
const NHOST: usize = 128;
const MAXSEQ: usize = 48;
const MAXDRAFT: u64 = 3;
const SLOT: usize = 8;

struct Req {
    seq: i32,
    tokens: Vec<i32>,
    target: usize,
    swapped: bool,
    preempted: bool,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn kv_of(tokens: &[i32], p: usize) -> u64 {
    let mut h: u64 = 1469598103934665603;
    for t in &tokens[..=p] {
        h = (h ^ (*t as u32 as u64)).wrapping_mul(1099511628211);
    }
    h
}

struct Store {
    bytes: Vec<u8>,
}
impl Store {
    fn new(blocks: usize) -> Store {
        Store {
            bytes: vec![0; blocks * BS * SLOT],
        }
    }
    fn write(&mut self, slot: usize, v: u64) {
        self.bytes[slot * SLOT..(slot + 1) * SLOT].copy_from_slice(&v.to_le_bytes());
    }
    fn read(&self, slot: usize) -> u64 {
        let mut b = [0u8; SLOT];
        b.copy_from_slice(&self.bytes[slot * SLOT..(slot + 1) * SLOT]);
        u64::from_le_bytes(b)
    }
}

fn copy_blocks(pairs: &[(i64, i64)], src: &Store, dst: &mut Store) {
    for &(s, d) in pairs {
        let (s, d) = (s as usize * BS * SLOT, d as usize * BS * SLOT);
        let block = src.bytes[s..s + BS * SLOT].to_vec();
        dst.bytes[d..d + BS * SLOT].copy_from_slice(&block);
    }
}

fn fail(msg: String) -> ! {
    eprintln!("toy_engine (Rust): {msg}");
    exit(1)
}

fn ok<T>(r: Result<T, kvb::Error>, what: &str) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--replay") {
        replay::run();
        return;
    }
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(400);
    let mut rng = Rng(args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1));
    let (abi, version) = kvb::version();
    if abi != kvb::KVBLOCKS_ABI_VERSION {
        fail(format!(
            "libkvblocks ABI {abi}, binding {}",
            kvb::KVBLOCKS_ABI_VERSION
        ));
    }
    let cfg = kvb::Config {
        num_blocks: NBLOCKS as i32,
        block_size: BS as i32,
        num_host_blocks: NHOST as i32,
        kv_events: true,
    };
    let mut mgr = ok(kvb::Manager::new(&cfg), "new");
    let mut kv = Store::new(NBLOCKS);
    let mut host = Store::new(NHOST);
    let prefixes: [[i32; 8]; 3] = [
        [11, 12, 13, 14, 15, 16, 17, 18],
        [21, 22, 23, 24, 25, 26, 27, 28],
        [31, 32, 33, 34, 35, 36, 37, 38],
    ];
    let mut reqs: Vec<Req> = Vec::new();
    let (mut checked, mut forks, mut swaps, mut accepted, mut preempts, mut done) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut hits, mut events, mut rollbacks) = (0i64, 0usize, 0u64);

    for _step in 0..steps {
        // 1. admissions: preempted requests first (recompute), then maybe a new one
        for r in reqs.iter_mut().filter(|r| r.preempted) {
            match mgr.add(&r.tokens, true) {
                Ok((seq, cached)) => {
                    r.seq = seq;
                    r.preempted = false;
                    hits += cached;
                }
                Err(e) if e.code == kvb::KVB_EOUTOFBLOCKS => break,
                Err(e) => fail(format!("re-add: {e}")),
            }
        }
        if rng.below(2) == 0 && reqs.len() < MAXSEQ {
            let pre = &prefixes[rng.below(3) as usize];
            let plen = 1 + rng.below(8) as usize;
            let mut tokens: Vec<i32> = pre[..plen].to_vec();
            for _ in 0..rng.below(6) {
                tokens.push(100 + rng.below(50) as i32);
            }
            let target = tokens.len() + 4 + rng.below(24) as usize;
            let mut r = Req {
                seq: -1,
                tokens,
                target,
                swapped: false,
                preempted: true,
            };
            match mgr.add(&r.tokens, false) {
                Ok((seq, cached)) => {
                    r.seq = seq;
                    r.preempted = false;
                    hits += cached;
                }
                Err(e) if e.code == kvb::KVB_EOUTOFBLOCKS => {}
                Err(e) => fail(format!("add: {e}")),
            }
            reqs.push(r);
        }
        let live: Vec<usize> = (0..reqs.len()).filter(|&i| !reqs[i].preempted).collect();
        // 2. parallel sampling: fork a resident sequence
        if !live.is_empty() && rng.below(7) == 0 && reqs.len() < MAXSEQ {
            let i = live[rng.below(live.len() as u64) as usize];
            if !reqs[i].swapped {
                let child = ok(mgr.fork(reqs[i].seq), "fork");
                let r = Req {
                    seq: child,
                    tokens: reqs[i].tokens.clone(),
                    target: reqs[i].target,
                    swapped: false,
                    preempted: false,
                };
                reqs.push(r);
                forks += 1;
            }
        }
        // 3. swap one out, or back in (the pairs are copied at once, before any copy)
        if !live.is_empty() && rng.below(5) == 0 {
            let r = &mut reqs[live[rng.below(live.len() as u64) as usize]];
            let res = if r.swapped {
                mgr.swap_in(r.seq)
            } else {
                mgr.swap_out(r.seq)
            };
            match res {
                Ok(pairs) => {
                    if r.swapped {
                        copy_blocks(&pairs, &host, &mut kv);
                    } else {
                        copy_blocks(&pairs, &kv, &mut host);
                    }
                    r.swapped = !r.swapped;
                    swaps += 1;
                }
                Err(e) if e.code == kvb::KVB_EOUTOFBLOCKS || e.code == kvb::KVB_EPENDING => {}
                Err(e) => fail(format!("swap: {e}")),
            }
        }
        // 4. rollback: a resident sequence forgets its last tokens (rejected continuation)
        if !live.is_empty() && rng.below(11) == 0 {
            let r = &mut reqs[live[rng.below(live.len() as u64) as usize]];
            if !r.swapped && r.tokens.len() > 2 {
                let keep = r.tokens.len() - 1 - rng.below(2) as usize;
                ok(mgr.truncate(r.seq, keep as i64), "truncate");
                r.tokens.truncate(keep);
                rollbacks += 1;
            }
        }
        // 5. the batch, some with draft slots
        let mut batch: Vec<usize> = Vec::new();
        let (mut seqs, mut qlens, mut drafts) = (Vec::new(), Vec::new(), Vec::new());
        let mut dtok: Vec<Vec<i32>> = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.preempted || r.swapped {
                continue;
            }
            let nc = mgr.num_computed(r.seq) as usize;
            let mut d = 0usize;
            if nc + 1 == r.tokens.len()
                && r.tokens.len() + (MAXDRAFT as usize) < r.target
                && rng.below(4) == 0
            {
                d = 1 + rng.below(MAXDRAFT) as usize;
                match mgr.reserve(r.seq, d as i64) {
                    Ok(()) => {}
                    Err(e) if e.code == kvb::KVB_EOUTOFBLOCKS => d = 0,
                    Err(e) => fail(format!("reserve: {e}")),
                }
            }
            batch.push(i);
            seqs.push(r.seq);
            qlens.push((r.tokens.len() - nc) as i32);
            drafts.push(d as i32);
            dtok.push((0..d).map(|_| 200 + rng.below(4) as i32).collect());
        }
        // 6. drain the copy-on-write copies, then metadata and the forward pass
        let copies = ok(mgr.take_copies(), "take_copies");
        let snapshot = Store {
            bytes: kv.bytes.clone(),
        };
        copy_blocks(&copies, &snapshot, &mut kv);
        let (slot_mapping, qo) = ok(mgr.metadata(&seqs, &qlens, &drafts), "metadata");
        for (b, &i) in batch.iter().enumerate() {
            let r = &reqs[i];
            let mut row = r.tokens.clone();
            row.extend_from_slice(&dtok[b]);
            let q0 = r.tokens.len() - qlens[b] as usize;
            for t in 0..(qlens[b] + drafts[b]) as usize {
                kv.write(
                    slot_mapping[qo[b] as usize + t] as usize,
                    kv_of(&row, q0 + t),
                );
            }
        }
        // 7. read back every sequence's K/V (resident on the device, swapped on the host)
        for r in reqs.iter().filter(|r| !r.preempted) {
            let table = ok(mgr.block_table(r.seq), "block_table");
            let (nt, nc) = (mgr.num_tokens(r.seq), mgr.num_computed(r.seq));
            if nt != r.tokens.len() as i64 || nc < 0 || nc > nt {
                fail(format!(
                    "seq {}: {nt} tokens (engine {}), {nc} computed",
                    r.seq,
                    r.tokens.len()
                ));
            }
            let store = if r.swapped { &host } else { &kv };
            for p in 0..nc as usize {
                let got = store.read(table[p / BS] as usize * BS + p % BS);
                if got != kv_of(&r.tokens, p) {
                    fail(format!(
                        "read-back mismatch: seq {} token {p} (block {}, {})",
                        r.seq,
                        table[p / BS],
                        if r.swapped { "host" } else { "device" }
                    ));
                }
                checked += 1;
            }
        }
        // 8. sampling: accepted drafts (computed), then one new token each (decode step)
        for (b, &i) in batch.iter().enumerate() {
            if drafts[b] > 0 {
                let a = rng.below(drafts[b] as u64 + 1) as usize;
                if a > 0 {
                    let r = &mut reqs[i];
                    ok(mgr.append(r.seq, &dtok[b][..a], true), "append drafts");
                    r.tokens.extend_from_slice(&dtok[b][..a]);
                    accepted += a as u64;
                }
            }
        }
        let mut next: Vec<i32> = batch.iter().map(|_| 1 + rng.below(97) as i32).collect();
        let mut seqs: Vec<i32> = batch.iter().map(|&i| reqs[i].seq).collect();
        loop {
            match mgr.append_batch(&seqs, &next) {
                Ok(()) => break,
                Err(e) if e.code == kvb::KVB_EOUTOFBLOCKS => {
                    // all-or-nothing: the youngest leaves the batch (freed, re-added later)
                    let i = batch.pop().unwrap();
                    seqs.pop();
                    next.pop();
                    ok(mgr.free(reqs[i].seq), "free (preempt)");
                    reqs[i].preempted = true;
                    preempts += 1;
                }
                Err(e) => fail(format!("append_batch: {e}")),
            }
        }
        for (b, &i) in batch.iter().enumerate() {
            reqs[i].tokens.push(next[b]);
        }
        // 9. finished sequences leave
        let mut k = 0;
        while k < reqs.len() {
            let r = &reqs[k];
            if !r.preempted && !r.swapped && r.tokens.len() >= r.target {
                ok(mgr.free(r.seq), "free");
                reqs.swap_remove(k);
                done += 1;
            } else {
                k += 1;
            }
        }
        ok(mgr.check_invariants(), "check");
        events += ok(mgr.take_events(), "take_events");
    }
    let st = mgr.stats();
    println!(
        "toy_engine (Rust, libkvblocks {version}): {steps} steps, {checked} tokens read back, \
         {done} finished, {forks} forks, {swaps} swaps, {accepted} accepted drafts, \
         {rollbacks} rollbacks, {preempts} preemptions, {hits} cached prompt tokens, \
         {events} events, {} blocks stored: OK",
        st.stored
    );
}
