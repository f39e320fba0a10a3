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

/// What a copy given `r` rows costs, written out: `f + max(c - f, r)` (`f` at most `c - 1`,
/// `c` at least 1), 0 for no rows.
fn copy_cost(c: u32, f: u32, r: u64) -> u64 {
    let c = u64::from(c.max(1));
    let f = u64::from(f).min(c - 1);
    if r == 0 { 0 } else { f + (c - f).max(r) }
}

/// Each card's load in the module's units.
fn loads(shares: &[Vec<RowShare>], cards: usize, c: u32, f: u32) -> Vec<u64> {
    let mut out = vec![0u64; cards];
    for s in shares.iter().flatten() {
        out[s.card] += copy_cost(c, f, s.rows as u64);
    }
    out
}

/// The lowest most-loaded copy any split of `n` rows over copies with `loads` can reach
/// (every split tried).
fn best_level(loads: &[u64], c: u32, f: u32, n: u64) -> u64 {
    fn go(loads: &[u64], cost: &dyn Fn(u64) -> u64, n: u64, worst: u64) -> u64 {
        match loads {
            [] if n == 0 => worst,
            [] => u64::MAX,
            [l, rest @ ..] => (0..=n)
                .map(|r| go(rest, cost, n - r, worst.max(l + cost(r))))
                .min()
                .unwrap_or(u64::MAX),
        }
    }
    go(loads, &|r| copy_cost(c, f, r), n, 0)
}

fn input<'a>(
    holders: &'a [Vec<usize>],
    rows: &'a [usize],
    keys: &'a [u64],
    cards: usize,
    c: u32,
    f: u32,
) -> SplitInput<'a> {
    SplitInput {
        holders,
        rows,
        keys,
        cards,
        rows_per_weight_read: c,
        fixed_rows_per_copy: f,
    }
}

proptest! {
    /// Every routed row goes to exactly one holder of its expert, each share at least one row
    /// and each copy at most once; an expert with one holder goes whole to it.
    #[test]
    fn every_row_goes_once_to_a_holder(
        experts in 1usize..12, cards in 1usize..6, seed in any::<u64>(), c in 0u32..30, f in 0u32..12,
    ) {
        let (holders, rows, keys) = layer(experts, cards, seed);
        let shares = split_rows(input(&holders, &rows, &keys, cards, c, f));
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

    /// The greedy pass: each replicated expert's split is the best one given the loads before
    /// it (no split of its rows over its holders leaves the most loaded of them lower).
    #[test]
    fn each_greedy_split_is_the_best_for_the_loads_it_meets(
        experts in 1usize..8, cards in 2usize..5, seed in any::<u64>(), c in 1u32..12, f in 0u32..6,
    ) {
        let (holders, mut rows, keys) = layer(experts, cards, seed);
        rows.iter_mut().for_each(|r| *r = (*r).min(12)); // keeps the search small
        let i = input(&holders, &rows, &keys, cards, c, f);
        let (shares, load) = greedy_split(i, CopyCost::new(c, f));
        prop_assert_eq!(&load, &loads(&shares, cards, c, f));
        // Replay the order the pass takes: single holders first, then the most routed.
        let mut placed = vec![Vec::new(); experts];
        let mut order: Vec<usize> = (0..experts).filter(|&e| rows[e] > 0).collect();
        order.sort_by_key(|&e| (holders[e].len() > 1, std::cmp::Reverse(rows[e]), e));
        for e in order {
            let before = loads(&placed, cards, c, f);
            placed[e] = shares[e].clone();
            if holders[e].len() > 1 {
                let after = loads(&placed, cards, c, f);
                let theirs: Vec<u64> = holders[e].iter().map(|&h| before[h]).collect();
                let got = holders[e].iter().map(|&h| after[h]).max().unwrap_or(0);
                prop_assert_eq!(got, best_level(&theirs, c, f, rows[e] as u64), "expert {}", e);
            }
        }
    }

    /// After the moves, the most loaded card is never above the greedy pass's, and no move of
    /// any number of one replicated expert's rows off it onto another of its holders would
    /// leave both cards below it (every count tried, not only the two the search looks at).
    #[test]
    fn no_single_move_lowers_the_most_loaded_card(
        experts in 1usize..10, cards in 2usize..6, seed in any::<u64>(), c in 1u32..16, f in 0u32..8,
    ) {
        let (holders, rows, keys) = layer(experts, cards, seed);
        let i = input(&holders, &rows, &keys, cards, c, f);
        let (greedy, _) = greedy_split(i, CopyCost::new(c, f));
        let shares = split_rows(i);
        let load = loads(&shares, cards, c, f);
        let peak = load.iter().copied().max().unwrap_or(0);
        prop_assert!(peak <= loads(&greedy, cards, c, f).into_iter().max().unwrap_or(0));
        let hi = (0..cards).find(|&x| load[x] == peak).unwrap();
        let on = |e: usize, card: usize| {
            shares[e].iter().find(|s| s.card == card).map_or(0, |s| s.rows as u64)
        };
        for e in (0..experts).filter(|&e| holders[e].len() > 1) {
            let r_from = on(e, hi);
            for &to in holders[e].iter().filter(|&&to| to != hi) {
                let r_to = on(e, to);
                for k in 1..=r_from {
                    let from_after =
                        load[hi] - copy_cost(c, f, r_from) + copy_cost(c, f, r_from - k);
                    let to_after = load[to] - copy_cost(c, f, r_to) + copy_cost(c, f, r_to + k);
                    prop_assert!(
                        from_after.max(to_after) >= peak,
                        "expert {} could move {} rows from card {} to {}", e, k, hi, to
                    );
                }
            }
        }
    }

    /// The same routing always splits the same way.
    #[test]
    fn splits_are_deterministic(experts in 1usize..12, cards in 1usize..6, seed in any::<u64>(), c in 0u32..30, f in 0u32..12) {
        let (holders, rows, keys) = layer(experts, cards, seed);
        let i = input(&holders, &rows, &keys, cards, c, f);
        prop_assert_eq!(split_rows(i), split_rows(i));
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
            fixed_rows_per_copy: 0,
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
fn rows_move_off_the_card_the_greedy_pass_left_over_full() {
    // Expert 0 on every card (30 rows), expert 1 on card 0 alone (10), expert 2 on cards 1
    // and 2 (10); a weight pass is worth 10 rows. The greedy pass gives card 0 expert 1 alone
    // (10), splits expert 0 over cards 1 and 2 (15 each) and then finds expert 2 best on one
    // of them (25). Moving 5 of expert 0's rows to card 0 takes the most loaded card to 20.
    let holders = vec![vec![0, 1, 2], vec![0], vec![1, 2]];
    let rows = [30, 10, 10];
    let i = input(&holders, &rows, &[0, 0, 0], 3, 10, 0);
    let (greedy, _) = greedy_split(i, CopyCost::new(10, 0));
    assert_eq!(loads(&greedy, 3, 10, 0), vec![10, 25, 15]);
    let shares = split_rows(i);
    assert_eq!(loads(&shares, 3, 10, 0), vec![20, 20, 15]);
    assert_eq!(shares[0].iter().map(|s| s.rows).sum::<usize>(), 30);
    assert!(shares[0].contains(&RowShare { card: 0, rows: 5 }));
}

#[test]
fn a_copys_fixed_part_is_less_than_all_of_a_rows_cost() {
    // The fixed part counts in every copy; at most `c - 1` of it, so a copy's weight pass is
    // at least one row, and a copy of no rows costs nothing.
    let cost = CopyCost::new(8, 3);
    assert_eq!((cost.fixed, cost.weight), (3, 5));
    assert_eq!(
        (cost.of(0), cost.of(1), cost.of(5), cost.of(9)),
        (0, 8, 8, 12)
    );
    let all = CopyCost::new(8, 20);
    assert_eq!((all.fixed, all.weight), (7, 1));
    let none = CopyCost::new(0, 0);
    assert_eq!((none.fixed, none.weight, none.of(3)), (0, 1, 3));
}

#[test]
fn a_second_copy_is_used_only_where_its_fixed_part_is_worth_it() {
    // 16 rows over two idle copies, a row's cost 10 of which 6 fixed: one copy costs 22, two
    // cost 14 each (6 + 8). With 1 of 10 fixed a copy at 8 rows costs 10: split too. With the
    // other copy's card busy (expert 1 alone there, 10 rows), splitting would leave it at
    // 16 + 6 + 4 = 26 over one copy's 22: the rows stay whole.
    let holders = vec![vec![0, 1], vec![1]];
    let split = |rows: [usize; 2], f: u32| split_rows(input(&holders, &rows, &[0, 0], 2, 10, f));
    assert_eq!(split([16, 0], 6)[0].len(), 2);
    assert_eq!(split([16, 0], 1)[0].len(), 2);
    assert_eq!(split([16, 10], 6)[0], vec![RowShare { card: 0, rows: 16 }]);
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
            fixed_rows_per_copy: 0,
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
        fixed_rows_per_copy: 0,
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
