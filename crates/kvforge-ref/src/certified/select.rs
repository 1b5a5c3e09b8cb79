//! The adaptive selector (seed 004 §3.3), its rung-1 expansion and the exploration draw (§6).
//!
//! Blocks are ranked by their Phase-1 normalised mass p_b (ties: lower block index first, so
//! the order is a total order a GPU sort can reproduce). K* is the least k whose top-k blocks,
//! together with the exact trailing partial block, cover τ_cov of the estimated mass, clamped
//! to [K_min, K_max] and to the number of full blocks.

/// Full blocks in selector order: p_b descending, then index ascending.
pub fn rank_blocks(p: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order
}

/// K* for blocks in `order` with masses `p`, where `exact_mass` is the normalised mass already
/// held exactly (the fp16 partial block).
pub fn k_star(p: &[f64], order: &[usize], exact_mass: f64, tau_cov: f64, k_min: usize, k_max: usize) -> usize {
    let total = exact_mass + p.iter().sum::<f64>();
    let mut covered = exact_mass;
    let mut k = 0;
    while k < order.len() && covered < tau_cov * total {
        covered += p[order[k]];
        k += 1;
    }
    k.clamp(k_min, k_max.max(k_min)).min(order.len())
}

/// Rung 1: K* doubled (at least one more block), beyond K_max, at most every block.
pub fn expand(k: usize, blocks: usize) -> usize {
    (2 * k).max(k + 1).min(blocks)
}

/// Blocks explored this step: the `count` blocks of `tail` with the smallest
/// `splitmix64(seed + b · φ)` (φ = 0x9E3779B97F4A7C15), in ascending hash order. A counter-
/// based hash rather than a stream RNG, so a GPU thread per block can compute its key and a
/// top-`count` selects the same set.
pub fn explore(tail: &[usize], count: usize, seed: u64) -> Vec<usize> {
    let mut keyed: Vec<(u64, usize)> = tail.iter().map(|&b| (splitmix64(seed.wrapping_add((b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))), b)).collect();
    keyed.sort_unstable();
    keyed.into_iter().take(count).map(|(_, b)| b).collect()
}

/// Number of blocks explored: ⌈frac · blocks⌉, at most the tail.
pub fn explore_count(frac: f64, blocks: usize, tail: usize) -> usize {
    ((frac * blocks as f64).ceil() as usize).min(tail)
}

/// SplitMix64 finaliser (Steele, Lea, Flood 2014).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coverage_and_clamp() {
        let p = [0.5, 0.3, 0.15, 0.05];
        let order = rank_blocks(&p);
        assert_eq!(order, vec![0, 1, 2, 3]);
        assert_eq!(k_star(&p, &order, 0.0, 0.8, 0, 10), 2);
        assert_eq!(k_star(&p, &order, 0.0, 0.81, 0, 10), 3);
        assert_eq!(k_star(&p, &order, 0.0, 0.81, 0, 1), 1);
        assert_eq!(k_star(&p, &order, 0.0, 0.1, 2, 10), 2);
        // The exact partial block's mass counts as covered.
        assert_eq!(k_star(&p, &order, 1.0, 0.5, 0, 10), 0);
        assert_eq!(k_star(&[], &[], 0.0, 0.995, 2, 128), 0);
    }

    #[test]
    fn ties_rank_by_index() {
        assert_eq!(rank_blocks(&[0.2, 0.4, 0.2, 0.4]), vec![1, 3, 0, 2]);
    }

    #[test]
    fn exploration_is_a_seeded_subset() {
        let tail: Vec<usize> = (10..60).collect();
        let a = explore(&tail, 3, 42);
        assert_eq!(a, explore(&tail, 3, 42));
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|b| tail.contains(b)));
        assert_ne!(a, explore(&tail, 3, 43));
        assert_eq!(explore_count(0.02, 100, 50), 2);
        assert_eq!(explore_count(0.02, 10, 5), 1);
        assert_eq!(explore_count(0.02, 10, 0), 0);
        assert_eq!(explore_count(0.0, 10, 5), 0);
    }
}
