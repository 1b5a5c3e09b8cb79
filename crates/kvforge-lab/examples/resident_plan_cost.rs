//! Host cost of planning one decode step (issue 29), CPU only, JSON lines on stdout: a full
//! re-plan of every page (what `KvCache::plan` does: per-head page lists, then
//! `kvforge_rt::plan`) against the device-resident table's incremental sync
//! (`ResidentTable::sync` + `shape`), over a batch whose sequences gain one token per step
//! with staggered tails, so that some tail fills and reopens at most steps, as in serving.
//! Neither includes uploads or launches.
//!
//!     cargo run --release -p kvforge-lab --example resident_plan_cost -- [--batch 128] [--context 32768] [--hkv 8] [--steps 256] [--spec specs/rdkv.toml --tier b4]
use std::time::Instant;

use kvforge_rt::resident::{PageSource, ResidentTable, Sync};
use kvforge_rt::{PageRef, Result, RtError};
use kvforge_spec::{Spec, TierId, TAIL_TIER};

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Page tables of `batch` sequences × `hkv` heads, grown a token at a time.
struct Tables {
    page: usize,
    target: TierId,
    next: u64,
    epoch: Vec<u64>,
    /// [seq][head]: full pages, tail (page, tokens).
    heads: Vec<Vec<(Vec<PageRef>, Option<(PageRef, usize)>)>>,
}

impl Tables {
    fn new(batch: usize, hkv: usize, context: usize, page: usize, target: TierId) -> Tables {
        let mut t = Tables { page, target, next: 0, epoch: vec![1; batch], heads: vec![vec![(Vec::new(), None); hkv]; batch] };
        for s in 0..batch {
            // Staggered: sequence s starts `s * page / batch` tokens past `context`.
            let len = context + s * page / batch.max(1);
            for h in 0..hkv {
                let full: Vec<PageRef> = (0..len / page).map(|_| t.alloc(target)).collect();
                let tail = (len % page > 0).then(|| (t.alloc(TAIL_TIER), len % page));
                t.heads[s][h] = (full, tail);
            }
        }
        t
    }

    fn alloc(&mut self, tier: TierId) -> PageRef {
        self.next += 1;
        PageRef { tier, index: self.next as u32, offset: self.next * 4096 }
    }

    /// One token for every sequence.
    fn step(&mut self) {
        for s in 0..self.heads.len() {
            for h in 0..self.heads[s].len() {
                let tail = match self.heads[s][h].1 {
                    Some(t) => t,
                    None => (self.alloc(TAIL_TIER), 0),
                };
                if tail.1 + 1 == self.page {
                    let full = self.alloc(self.target);
                    self.heads[s][h].0.push(full);
                    self.heads[s][h].1 = None;
                } else {
                    self.heads[s][h].1 = Some((tail.0, tail.1 + 1));
                }
            }
        }
    }

    /// What `KvCache::plan` builds before planning.
    fn page_lists(&self) -> Vec<Vec<Vec<(PageRef, usize)>>> {
        self.heads.iter().map(|s| s.iter().map(|(full, tail)| full.iter().map(|&p| (p, self.page)).chain(*tail).collect()).collect()).collect()
    }
}

impl PageSource for Tables {
    fn layout_epoch(&self, seq: usize) -> Result<u64> {
        self.epoch.get(seq).copied().ok_or(RtError::NoSequence(seq))
    }
    fn full_pages(&self, seq: usize, head: usize) -> Result<usize> {
        Ok(self.heads[seq][head].0.len())
    }
    fn full_page(&self, seq: usize, head: usize, index: usize) -> Result<PageRef> {
        self.heads[seq][head].0.get(index).copied().ok_or(RtError::NoPage { seq, head, index })
    }
    fn tail_page(&self, seq: usize, head: usize) -> Result<Option<(PageRef, usize)>> {
        Ok(self.heads[seq][head].1)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let batch = arg(&args, "--batch", 128usize);
    let context = arg(&args, "--context", 32768usize);
    let hkv = arg(&args, "--hkv", 8usize);
    let steps = arg(&args, "--steps", 256usize);
    let spec_path = arg(&args, "--spec", String::from("specs/rdkv.toml"));
    let spec = Spec::load(spec_path.as_ref())?;
    let tier = arg(&args, "--tier", String::from("b4"));
    let target = spec.tier(&tier).ok_or_else(|| format!("no tier {tier}"))?.id;
    let (d, gqa) = (128, 4);
    let page_bytes: Vec<usize> = (0..spec.tiers.len()).map(|t| spec.segment(t as TierId, d).page_bytes).collect();
    let seqs: Vec<usize> = (0..batch).collect();

    let mut tables = Tables::new(batch, hkv, context, spec.page.tokens, target);
    let mut table = ResidentTable::new(&spec, d, gqa, hkv, u64::MAX - 4095);
    let (mut replan, mut resident, mut uploads) = (Vec::new(), Vec::new(), Vec::new());
    let mut rebuild_ms = Vec::new();
    for _ in 0..steps {
        tables.step();
        let t = Instant::now();
        let lists = tables.page_lists();
        let p = kvforge_rt::plan(&spec, d, gqa, &lists, &|t| page_bytes[t as usize], &|_| 528)?;
        replan.push(t.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(&p);
        let t = Instant::now();
        let sync = table.sync(&tables, &seqs)?;
        table.shape(&spec, &|t| page_bytes[t as usize], &mut |_| Ok(528))?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        match sync {
            Sync::Rebuilt => rebuild_ms.push(ms),
            Sync::Dirty(r) => {
                resident.push(ms);
                uploads.push(kvforge_rt::resident::upload_spans(&r, 4096).len() as f64);
            }
        }
        assert_eq!((table.plan().variant.clone(), table.plan().splits), (p.variant, p.splits));
    }
    let entries = table.plan().page_offsets.len();
    println!(
        "{{\"batch\": {batch}, \"context\": {context}, \"hkv\": {hkv}, \"steps\": {steps}, \"entries\": {entries}, \"replan_ms_median\": {:.4}, \"resident_ms_median\": {:.4}, \"resident_ms_max\": {:.4}, \"rebuilds\": {}, \"rebuild_ms_median\": {:.4}, \"upload_calls_per_step_mean\": {:.2}}}",
        median(replan),
        median(resident.clone()),
        resident.iter().cloned().fold(0.0, f64::max),
        rebuild_ms.len(),
        if rebuild_ms.is_empty() { 0.0 } else { median(rebuild_ms) },
        2.0 * uploads.iter().sum::<f64>() / uploads.len().max(1) as f64,
    );
    Ok(())
}
