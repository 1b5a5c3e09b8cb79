//! `PagedImportance`, the EMA of a window kept on the device, against `ImportanceTracker`,
//! the host fold it replaces: the same numbers over invocations while pages are appended and
//! dropped; and the positions a window is named by.

use kvforge_control::runtime::{PositionMap, SimCache};
use kvforge_control::{ImportanceError, ImportanceTracker, PageKey, PagedImportance};
use proptest::prelude::*;

/// One controller period: per kv head, the pages' first tokens and, per decode step, each
/// page's share (None where that step did not see the page, e.g. before it existed).
type Period = Vec<(Vec<usize>, Vec<Vec<Option<f64>>>)>;

fn periods(page: usize) -> impl Strategy<Value = Vec<Period>> {
    // Each period: per head, a set of live page indices (drops leave gaps) and per step a share.
    let head = (prop::collection::vec(any::<bool>(), 1..12), prop::collection::vec(prop::collection::vec(prop::option::weighted(0.9, 0.0f64..1.0), 12), 1..5));
    prop::collection::vec(prop::collection::vec(head, 1..4), 1..8).prop_map(move |ps| {
        ps.into_iter()
            .map(|heads| {
                heads
                    .into_iter()
                    .map(|(live, steps)| {
                        let firsts: Vec<usize> = live.iter().enumerate().filter(|x| *x.1).map(|(i, _)| i * page).collect();
                        let steps = steps.into_iter().map(|s| s.into_iter().take(firsts.len()).collect()).collect();
                        (firsts, steps)
                    })
                    .collect()
            })
            .collect()
    })
}

proptest! {
    #[test]
    fn paged_importance_is_the_host_tracker(ps in periods(64), beta in 0.0f64..0.99) {
        let mut host = ImportanceTracker::new(beta);
        let mut dense = PagedImportance::new(beta, 64).unwrap();
        let heads = ps.iter().map(Vec::len).max().unwrap_or(0);
        for period in &ps {
            // The host observes every step's shares; the device keeps their maximum per page.
            let mut firsts = Vec::new();
            let mut window = Vec::new();
            for (h, (fs, steps)) in period.iter().enumerate() {
                let mut w: Vec<Option<f64>> = vec![None; fs.len()];
                for step in steps {
                    for (i, m) in step.iter().enumerate() {
                        if let Some(m) = *m {
                            host.observe(PageKey { head: h, first_token: fs[i] }, m);
                            w[i] = Some(w[i].map_or(m, |x: f64| x.max(m)));
                        }
                    }
                }
                firsts.push(fs.clone());
                window.push(w);
            }
            host.roll();
            dense.roll(&firsts, &window).unwrap();
            for h in 0..heads {
                for i in 0..12 {
                    let k = PageKey { head: h, first_token: i * 64 };
                    prop_assert_eq!(dense.get(k), host.get(k), "{:?}", k);
                }
            }
        }
    }
}

#[test]
fn paged_importance_refuses_what_it_cannot_name() {
    assert_eq!(PagedImportance::new(1.0, 64), Err(ImportanceError::Beta(1.0)));
    assert_eq!(PagedImportance::new(0.5, 0), Err(ImportanceError::PageTokens));
    let mut p = PagedImportance::new(0.5, 64).unwrap();
    assert_eq!(p.roll(&[vec![0, 64]], &[vec![Some(0.1)]]), Err(ImportanceError::Shape { head: 0, window: 1, pages: 2 }));
    assert_eq!(p.roll(&[vec![0, 65]], &[vec![Some(0.1), None]]), Err(ImportanceError::Unaligned { head: 0, first_token: 65, page_tokens: 64 }));
    assert!(matches!(p.roll(&[vec![0]], &[vec![Some(f64::NAN)]]), Err(ImportanceError::Share { .. })));
    // Refused rolls change nothing.
    assert_eq!(p.get(PageKey { head: 0, first_token: 0 }), 0.0);
    p.roll(&[vec![0, 128]], &[vec![Some(0.4), None]]).unwrap();
    assert_eq!(p.get(PageKey { head: 0, first_token: 0 }), 0.4);
    assert_eq!(p.get(PageKey { head: 0, first_token: 128 }), 0.0);
    assert_eq!(p.get(PageKey { head: 3, first_token: 0 }), 0.0);
}

#[test]
fn first_tokens_name_pages_across_drops() {
    let spec = kvforge_spec::Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/rdkv.toml")).unwrap();
    let p = spec.page.tokens;
    let mut c = SimCache::new(spec.clone(), 64, 2, 1);
    let s = c.add_sequence();
    c.append(s, 5 * p + 3);
    let mut pos = PositionMap::new(s, 2);
    pos.sync(&c).unwrap();
    assert_eq!(pos.first_tokens(&c).unwrap(), vec![vec![0, p, 2 * p, 3 * p, 4 * p, 5 * p]; 2]);
    // Drop pages 1 and 3 of head 0 as a plan would, then the map forgets them.
    let costs = kvforge_control::TierCosts::from_spec(&spec, 64, kvforge_control::CostModel::Resident);
    let view = pos.view(&c, costs, |_, _| Default::default()).unwrap();
    use kvforge_control::runtime::PagedCache;
    c.retier_pages(s, &[(0, 1, 5), (0, 3, 5)]).unwrap();
    let plan = kvforge_control::Plan {
        decisions: vec![
            kvforge_control::Decision { page: kvforge_control::PageId { head: 0, index: 1 }, from_tier: 1, to_tier: 5 },
            kvforge_control::Decision { page: kvforge_control::PageId { head: 0, index: 3 }, from_tier: 1, to_tier: 5 },
        ],
        budget_bytes: 0.0,
        cost_before: 0.0,
        cost_after: 0.0,
        distortion_before: 0.0,
        distortion_after: 0.0,
        lambda: 0.0,
        duality_gap: 0.0,
        feasible: true,
        forced: Vec::new(),
    };
    pos.forget(&view, &plan);
    c.append(s, p);
    pos.sync(&c).unwrap();
    assert_eq!(pos.first_tokens(&c).unwrap(), vec![vec![0, 2 * p, 4 * p, 5 * p, 6 * p], vec![0, p, 2 * p, 3 * p, 4 * p, 5 * p, 6 * p]]);
}
