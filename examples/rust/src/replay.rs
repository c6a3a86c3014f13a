//! `toy_engine --replay`: op sequences from stdin run through the binding, one observation
//! line per op, so that a test can run the same sequence through the Python `BlockManager`
//! (the same core, another binding) and compare line by line (tests/test_capi.py).
//!
//! Ops (ids are the caller's names; tokens and numbers comma-separated, `-` for none):
//!   new NUM_BLOCKS BLOCK_SIZE NUM_HOST_BLOCKS    a fresh manager
//!   add ID TOKENS | append ID TOKENS | batch IDS TOKENS | reserve ID N | truncate ID N
//!   fork PARENT CHILD | free ID | out ID | in ID | sched IDS QLENS | copies
//! Observation: `<result> | <state>`: result `ok`, `ok <value>` (cached tokens, pairs) or
//! `err <class>` (oob, unknown, state, arg); state: every live id in name order as
//! `id:tokens:computed:blocks:swapped` and the pending copies.

use crate::kvb;
use std::collections::BTreeMap;
use std::io::{self, BufRead, Write};

fn class(code: i32) -> &'static str {
    match code {
        -2 => "oob",
        -7 => "unknown",
        -5 | -9 | -10 | -11 => "state",
        -3 | -4 | -8 => "arg",
        _ => "other",
    }
}

fn nums(s: &str) -> Vec<i64> {
    if s == "-" {
        return Vec::new();
    }
    s.split(',').map(|x| x.parse().expect("a number")).collect()
}

fn pairs(p: &[(i64, i64)]) -> String {
    let v: Vec<String> = p.iter().map(|(a, b)| format!("{a}>{b}")).collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(",")
    }
}

struct State {
    mgr: kvb::Manager,
    slots: BTreeMap<String, i32>,
}

impl State {
    /// The slot of a name; -1 for an unknown one, so the library itself refuses it (in the
    /// order of its own checks).
    fn slot(&self, id: &str) -> Result<i32, kvb::Error> {
        Ok(self.slots.get(id).copied().unwrap_or(-1))
    }

    fn observe(&mut self) -> String {
        let mut parts = Vec::new();
        for (id, &s) in &self.slots {
            let table = self.mgr.block_table(s).unwrap_or_default();
            let t: Vec<String> = table.iter().map(|b| b.to_string()).collect();
            let swapped = unsafe { kvb::kvb_manager_is_swapped(self.mgr.raw(), s) };
            parts.push(format!(
                "{id}:{}:{}:{}:{}",
                self.mgr.num_tokens(s),
                self.mgr.num_computed(s),
                t.join("."),
                swapped
            ));
        }
        let pending = unsafe { kvb::kvb_manager_pending_copies(self.mgr.raw_mut()) };
        format!("{} copies={pending}", parts.join(" "))
    }

    fn op(&mut self, w: &[&str]) -> Result<String, kvb::Error> {
        let toks = |i: usize| -> Vec<i32> { nums(w[i]).iter().map(|&x| x as i32).collect() };
        match w[0] {
            "add" => {
                if self.slots.contains_key(w[1]) {
                    return Err(kvb::Error {
                        code: -8,
                        a: 0,
                        b: 0,
                        what: "duplicate".into(),
                    });
                }
                let (s, cached) = self.mgr.add(&toks(2), false)?;
                self.slots.insert(w[1].to_string(), s);
                Ok(format!("ok {cached}"))
            }
            "append" => {
                let s = self.slot(w[1])?;
                self.mgr.append(s, &toks(2), false).map(|_| "ok".into())
            }
            "batch" => {
                let ids: Vec<&str> = if w[1] == "-" {
                    Vec::new()
                } else {
                    w[1].split(',').collect()
                };
                let mut seqs = Vec::new();
                for id in ids {
                    seqs.push(self.slot(id)?);
                }
                self.mgr.append_batch(&seqs, &toks(2)).map(|_| "ok".into())
            }
            "reserve" => {
                let s = self.slot(w[1])?;
                self.mgr
                    .reserve(s, w[2].parse().unwrap())
                    .map(|_| "ok".into())
            }
            "truncate" => {
                let s = self.slot(w[1])?;
                self.mgr
                    .truncate(s, w[2].parse().unwrap())
                    .map(|_| "ok".into())
            }
            "fork" => {
                let p = self.slot(w[1])?;
                if p >= 0 && self.slots.contains_key(w[2]) {
                    return Err(kvb::Error {
                        code: -8,
                        a: 0,
                        b: 0,
                        what: "duplicate".into(),
                    });
                }
                let c = self.mgr.fork(p)?;
                self.slots.insert(w[2].to_string(), c);
                Ok("ok".into())
            }
            "free" => {
                let s = self.slot(w[1])?;
                self.mgr.free(s)?;
                self.slots.remove(w[1]);
                Ok("ok".into())
            }
            "out" | "in" => {
                let s = self.slot(w[1])?;
                let p = if w[0] == "out" {
                    self.mgr.swap_out(s)?
                } else {
                    self.mgr.swap_in(s)?
                };
                Ok(format!("ok {}", pairs(&p)))
            }
            "sched" => {
                let ids: Vec<&str> = if w[1] == "-" {
                    Vec::new()
                } else {
                    w[1].split(',').collect()
                };
                let mut seqs = Vec::new();
                for id in ids {
                    seqs.push(self.slot(id)?);
                }
                let q: Vec<i32> = toks(2);
                self.mgr.schedule(&seqs, &q).map(|_| "ok".into())
            }
            "copies" => self.mgr.take_copies().map(|p| format!("ok {}", pairs(&p))),
            other => panic!("unknown op {other}"),
        }
    }
}

pub fn run() {
    let stdin = io::stdin();
    let mut out = io::BufWriter::new(io::stdout());
    let mut st: Option<State> = None;
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.is_empty() {
            continue;
        }
        if w[0] == "new" {
            let cfg = kvb::Config {
                num_blocks: w[1].parse().unwrap(),
                block_size: w[2].parse().unwrap(),
                num_host_blocks: w[3].parse().unwrap(),
                kv_events: false,
            };
            st = Some(State {
                mgr: kvb::Manager::new(&cfg).expect("new"),
                slots: BTreeMap::new(),
            });
            writeln!(out, "new").unwrap();
            continue;
        }
        let s = st.as_mut().expect("new first");
        let r = match s.op(&w) {
            Ok(r) => r,
            Err(e) => format!("err {}", class(e.code)),
        };
        let obs = s.observe();
        writeln!(out, "{r} | {obs}").unwrap();
    }
}
