use super::*;
use proptest::prelude::*;

/// A layer: each expert's holders (1 to `cards` of them) and rows, from a seed.
fn layer(experts: usize, cards: usize, seed: u64) -> (Vec<Vec<usize>>, Vec<usize>, Vec<u64>) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut holders = Vec::new();
    let mut rows = Vec::new();
    let mut keys = Vec::new();
    for _ in 0..experts {
        let copies = 1 + (next() % cards as u64) as usize;
        let first = (next() % cards as u64) as usize;
        let mut h: Vec<usize> = (0..copies).map(|i| (first + i) % cards).collect();
        h.sort_unstable();
        holders.push(h);
        // Skewed: most experts a few rows, some many, some none.
        rows.push(match next() % 4 {
            0 => 0,
            1 => (next() % 40) as usize,
            _ => (next() % 5) as usize,
        });
        keys.push(next() % 97);
    }
    (holders, rows, keys)
}

/// A card's load in the module's units: `max(c, r)` per expert with `r > 0` rows.
fn loads(shares: &[Vec<RowShare>], cards: usize, c: u64) -> Vec<u64> {
    let mut out = vec![0u64; cards];
    for s in shares.iter().flatten() {
        out[s.card] += c.max(s.rows as u64);
    }
    out
}

/// The lowest most-loaded copy any split of `n` rows over copies with `loads` can reach
/// (every split tried).
fn best_level(loads: &[u64], c: u64, n: u64) -> u64 {
    fn go(loads: &[u64], c: u64, n: u64, worst: u64) -> u64 {
        match loads {
            [] if n == 0 => worst,
            [] => u64::MAX,
            [l, rest @ ..] => (0..=n)
                .map(|r| {
                    let here = if r == 0 { *l } else { l + c.max(r) };
                    go(rest, c, n - r, worst.max(here))
                })
                .min()
                .unwrap_or(u64::MAX),
        }
    }
    go(loads, c, n, 0)
}

proptest! {
    /// Every routed row goes to exactly one holder of its expert, each share at least one row
    /// and each copy at most once; an expert with one holder goes whole to it.
    #[test]
    fn every_row_goes_once_to_a_holder(
        experts in 1usize..12, cards in 1usize..6, seed in any::<u64>(), c in 0u32..30,
    ) {
        let (holders, rows, keys) = layer(experts, cards, seed);
        let shares = split_rows(SplitInput { holders: &holders, rows: &rows, keys: &keys, cards, rows_per_weight_read: c });
        prop_assert_eq!(shares.len(), experts);
        for e in 0..experts {
            let given: usize = shares[e].iter().map(|s| s.rows).sum();
            prop_assert_eq!(given, rows[e]);
            prop_assert!(shares[e].iter().all(|s| s.rows >= 1 && holders[e].contains(&s.card)));
            let mut cards_used: Vec<usize> = shares[e].iter().map(|s| s.card).collect();
            cards_used.sort_unstable();
            cards_used.dedup();
            prop_assert_eq!(cards_used.len(), shares[e].len());
            if holders[e].len() == 1 && rows[e] > 0 {
                prop_assert_eq!(&shares[e], &vec![RowShare { card: holders[e][0], rows: rows[e] }]);
            }
        }
    }

    /// Each replicated expert's split is the best one given the loads before it: no split of
    /// its rows over its holders leaves the most loaded of them lower.
    #[test]
    fn each_split_is_the_best_for_the_loads_it_meets(
        experts in 1usize..8, cards in 2usize..5, seed in any::<u64>(), c in 1u32..12,
    ) {
        let (holders, mut rows, keys) = layer(experts, cards, seed);
        rows.iter_mut().for_each(|r| *r = (*r).min(12)); // keeps the search small
        let shares = split_rows(SplitInput { holders: &holders, rows: &rows, keys: &keys, cards, rows_per_weight_read: c });
        let c = u64::from(c);
        // Replay the order the module takes: single holders first, then the most routed.
        let mut placed = vec![Vec::new(); experts];
        let mut order: Vec<usize> = (0..experts).filter(|&e| rows[e] > 0).collect();
        order.sort_by_key(|&e| (holders[e].len() > 1, std::cmp::Reverse(rows[e]), e));
        for e in order {
            let before = loads(&placed, cards, c);
            placed[e] = shares[e].clone();
            if holders[e].len() > 1 {
                let after = loads(&placed, cards, c);
                let theirs: Vec<u64> = holders[e].iter().map(|&h| before[h]).collect();
                let got = holders[e].iter().map(|&h| after[h]).max().unwrap_or(0);
                prop_assert_eq!(got, best_level(&theirs, c, rows[e] as u64), "expert {}", e);
            }
        }
    }

    /// The same routing always splits the same way.
    #[test]
    fn splits_are_deterministic(experts in 1usize..12, cards in 1usize..6, seed in any::<u64>(), c in 0u32..30) {
        let (holders, rows, keys) = layer(experts, cards, seed);
        let input = SplitInput { holders: &holders, rows: &rows, keys: &keys, cards, rows_per_weight_read: c };
        prop_assert_eq!(split_rows(input), split_rows(input));
    }
}

#[test]
fn a_weight_bound_expert_stays_on_one_copy_and_a_compute_bound_one_is_split_evenly() {
    let holders = vec![vec![0, 1]];
    let keys = [0];
    let split = |rows: usize, c: u32| {
        split_rows(SplitInput {
            holders: &holders,
            rows: &[rows],
            keys: &keys,
            cards: 2,
            rows_per_weight_read: c,
        })
        .remove(0)
    };
    // 6 rows cost what one weight pass does: a second copy would finish no sooner.
    assert_eq!(split(6, 8), vec![RowShare { card: 0, rows: 6 }]);
    // 40 rows, 8 a pass: two copies of 20 each.
    assert_eq!(
        split(40, 8),
        vec![
            RowShare { card: 0, rows: 20 },
            RowShare { card: 1, rows: 20 }
        ]
    );
    // Never split, whatever the rows.
    assert_eq!(
        split(1000, u32::MAX),
        vec![RowShare {
            card: 0,
            rows: 1000
        }]
    );
}

#[test]
fn ties_go_to_the_holder_the_key_points_at_and_loads_decide_first() {
    let holders = vec![vec![0, 1, 2], vec![2]];
    let go = |key: u64, rows: [usize; 2]| {
        split_rows(SplitInput {
            holders: &holders,
            rows: &rows,
            keys: &[key, 0],
            cards: 3,
            rows_per_weight_read: 4,
        })
    };
    assert_eq!(go(1, [1, 0])[0], vec![RowShare { card: 1, rows: 1 }]);
    assert_eq!(go(5, [1, 0])[0], vec![RowShare { card: 2, rows: 1 }]);
    // Card 2 computes expert 1: the key's pick is passed over for the next idle holder.
    assert_eq!(go(5, [1, 3])[0], vec![RowShare { card: 0, rows: 1 }]);
}

#[test]
fn an_expert_no_card_holds_gets_no_share() {
    let holders = vec![vec![], vec![0, 1]];
    let shares = split_rows(SplitInput {
        holders: &holders,
        rows: &[3, 2],
        keys: &[0, 0],
        cards: 2,
        rows_per_weight_read: 1,
    });
    assert!(shares[0].is_empty());
    assert_eq!(shares[1].iter().map(|s| s.rows).sum::<usize>(), 2);
}

#[test]
fn balancedness_is_the_mean_over_the_largest() {
    assert_eq!(balancedness(&[2.0, 4.0]), 0.75);
    assert_eq!(balancedness(&[3.0, 3.0, 3.0]), 1.0);
    assert_eq!(balancedness(&[0.0, 0.0, 6.0]), 1.0 / 3.0);
    // Nothing to balance: even.
    assert_eq!(balancedness(&[0.0, 0.0]), 1.0);
    assert_eq!(balancedness(&[]), 1.0);
}

#[test]
fn a_cursor_hands_each_experts_rows_to_its_shares_in_turn() {
    let shares = vec![
        vec![RowShare { card: 1, rows: 2 }, RowShare { card: 0, rows: 1 }],
        vec![],
    ];
    let mut cursor = ShareCursor::new(&shares);
    let got: Vec<Option<usize>> = (0..4).map(|_| cursor.next_card(0)).collect();
    assert_eq!(got, vec![Some(1), Some(1), Some(0), None]);
    assert_eq!(cursor.next_card(1), None, "an expert without shares");
    assert_eq!(cursor.next_card(7), None, "an expert past the layer's");
}
