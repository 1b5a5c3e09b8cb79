//! Codebook training: deterministic for a seed, unit norm, loadable as a spec codebook.

use std::collections::HashMap;

use kvforge_ref::{train_codebook, uniform_unit_samples};
use kvforge_spec::Codebook;

fn norms(words: &[f32], group: usize) -> Vec<f32> {
    words.chunks_exact(group).map(|w| w.iter().map(|x| x * x).sum::<f32>().sqrt()).collect()
}

#[test]
fn uniform_samples_are_unit_and_deterministic() {
    let a = uniform_unit_samples(500, 16, 3);
    assert_eq!(a.len(), 500 * 16);
    assert_eq!(a, uniform_unit_samples(500, 16, 3));
    assert_ne!(a, uniform_unit_samples(500, 16, 4));
    assert!(norms(&a, 16).iter().all(|n| (n - 1.0).abs() < 1e-6));
    // Uniform on the sphere: the mean is near zero.
    for c in 0..16 {
        let m: f32 = a.chunks_exact(16).map(|s| s[c]).sum::<f32>() / 500.0;
        assert!(m.abs() < 0.05, "channel {c} mean {m}");
    }
}

#[test]
fn training_is_deterministic_and_unit_norm() {
    for (group, entries) in [(16, 16), (16, 64), (32, 8), (4, 256)] {
        let s = uniform_unit_samples(600, group, 1);
        let a = train_codebook(&s, group, entries, 9, 8);
        assert_eq!(a.len(), entries * group);
        assert_eq!(a, train_codebook(&s, group, entries, 9, 8), "same seed, same bits");
        assert_ne!(a, train_codebook(&s, group, entries, 10, 8), "another seed, another start");
        assert!(norms(&a, group).iter().all(|n| (n - 1.0).abs() < 1e-6));
        // Every codeword is used: no duplicate words.
        for (i, w) in a.chunks_exact(group).enumerate() {
            for v in a.chunks_exact(group).skip(i + 1) {
                assert_ne!(w, v);
            }
        }
        let cb = Codebook::new("trained".into(), entries, group, a.clone(), HashMap::new());
        let path = std::env::temp_dir().join(format!("kvforge-ref-cb-{}-{group}-{entries}.safetensors", std::process::id()));
        cb.save(&path).unwrap();
        let back = Codebook::load(&path, "trained", entries, group).expect("trained codebooks pass the spec's unit-norm check");
        std::fs::remove_file(&path).ok();
        assert_eq!(back.data, a);
    }
}

#[test]
fn training_improves_on_its_start() {
    // Mean best cosine of held-out samples: trained codebook beats the random start.
    let (group, entries) = (8, 16);
    let train = uniform_unit_samples(2000, group, 1);
    let test = uniform_unit_samples(1000, group, 2);
    let fit = |cb: &[f32]| test.chunks_exact(group).map(|x| cb.chunks_exact(group).map(|w| w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>()).fold(f32::MIN, f32::max)).sum::<f32>() / 1000.0;
    let start = train_codebook(&train, group, entries, 5, 0);
    let trained = train_codebook(&train, group, entries, 5, 30);
    assert!(fit(&trained) > fit(&start) + 0.01, "trained {} vs start {}", fit(&trained), fit(&start));
}

#[test]
fn zero_and_empty_samples_are_tolerated() {
    let mut s = vec![0f32; 16 * 10];
    s.extend(uniform_unit_samples(3, 16, 1));
    let cb = train_codebook(&s, 16, 4, 0, 5);
    assert!(norms(&cb, 16).iter().all(|n| (n - 1.0).abs() < 1e-6));
    let cb = train_codebook(&[], 16, 4, 0, 5);
    assert!(norms(&cb, 16).iter().all(|n| (n - 1.0).abs() < 1e-6));
}
