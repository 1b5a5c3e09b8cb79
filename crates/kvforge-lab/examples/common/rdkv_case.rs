//! The case `controller_cost rdkv` and `rdkv_prof` both time: RDKV's allocation once after
//! prefill at 32K tokens × 8 kv heads (gqa 4, d 128), budget 25% of fp16, drawn from one seed
//! so that both report the same plan digest.
use kvforge_control::rdkv::channel_weights;
use kvforge_control::runtime::{PositionMap, SimCache};
use kvforge_control::*;
use kvforge_spec::Spec;
use rand::{Rng, SeedableRng};

pub struct RdkvCase {
    pub d: usize,
    pub heads: usize,
    pub ctx: usize,
    /// Per kv head, per token: column sums of one layer's prefill attention, heavy tailed (a
    /// few heavy hitters, most tokens light).
    pub tok: Vec<Vec<f64>>,
    /// Channel weights from Q/K rows (seed 002's per-channel stage).
    pub cw: Vec<f64>,
    pub costs: TierCosts,
    pub limits: Limits,
    pub cache: SimCache,
    pub pos: PositionMap,
    pub rdkv: RdkvController,
}

impl RdkvCase {
    pub fn new(spec: &Spec) -> Result<RdkvCase, Box<dyn std::error::Error + Send + Sync>> {
        let (d, heads, ctx, gqa) = (128usize, 8usize, 32768usize, 4usize);
        let p = spec.page.tokens;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let tok: Vec<Vec<f64>> = (0..heads).map(|_| (0..ctx).map(|_| rng.gen::<f64>().powf(6.0) * gqa as f64).collect()).collect();
        let q: Vec<f64> = (0..64 * d).map(|_| rng.gen::<f64>() - 0.5).collect();
        let k: Vec<f64> = (0..2048 * d).map(|_| rng.gen::<f64>() - 0.5).collect();
        let cw = channel_weights(&q, &k, d);
        let costs = TierCosts::from_spec(spec, d, CostModel::Resident);
        let fp16 = costs.cost(kvforge_spec::TAIL_TIER, p) / p as f64;
        let limits = Limits { budget: Budget::PerToken(0.25 * fp16), protection: Protection::default() };
        let mut cache = SimCache::new(spec.clone(), d, heads, 1);
        let seq = cache.add_sequence();
        cache.append(seq, ctx);
        let mut pos = PositionMap::new(seq, heads);
        pos.sync(&cache)?;
        let rdkv = RdkvController::new(spec)?;
        Ok(RdkvCase { d, heads, ctx, tok, cw, costs, limits, cache, pos, rdkv })
    }
}
