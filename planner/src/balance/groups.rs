//! Hierarchical placement, as DeepSeek's EPLB does when its nodes divide the expert groups: the
//! cards form `groups` equal groups, each behind its own network boundary (a host, a switch, a
//! link from the attention node), and every copy of an expert stays inside one group.
//!
//! 1. **Experts to groups**: whole experts, heaviest first, each to the group with the least load
//!    that has room (an even count per group, the first groups taking one more when the experts
//!    do not divide), so each group's link carries an even share of the rows.
//! 2. **Inside each group**: the global placement ([`super::balance_layer`]) of the group's
//!    experts on its cards, with the group's share of the extra copies.

use super::{LayerHolders, balance_layer};

/// Which group holds each expert: `experts` split into `groups` groups of even counts, by load.
fn experts_to_groups(load: &[u64], groups: usize) -> Vec<usize> {
    let n = load.len();
    let room = |g: usize| n / groups + usize::from(g < n % groups);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| load[b].cmp(&load[a]).then(a.cmp(&b)));
    let mut group_load = vec![0u64; groups];
    let mut count = vec![0usize; groups];
    let mut group_of = vec![0usize; n];
    for e in order {
        let g = (0..groups)
            .filter(|&g| count[g] < room(g))
            .min_by(|&a, &b| group_load[a].cmp(&group_load[b]).then(a.cmp(&b)))
            .unwrap_or(0);
        group_of[e] = g;
        group_load[g] += load[e];
        count[g] += 1;
    }
    group_of
}

/// One layer's placement by load on `cards` cards in `groups` equal groups (consecutive card
/// indices), with `redundant` extra copies spread evenly over the groups (the first groups take
/// one more when they do not divide); every copy of an expert inside one group. `groups` of 0
/// or 1, or one that does not divide `cards`, places globally.
pub fn balance_layer_in_groups(
    load: &[u64],
    cards: usize,
    groups: usize,
    redundant: usize,
) -> LayerHolders {
    if groups <= 1 || cards == 0 || !cards.is_multiple_of(groups) || load.len() < groups {
        return balance_layer(load, cards, redundant);
    }
    let per_group = cards / groups;
    let group_of = experts_to_groups(load, groups);
    let mut holders = vec![Vec::new(); load.len()];
    for g in 0..groups {
        let members: Vec<usize> = (0..load.len()).filter(|&e| group_of[e] == g).collect();
        let sub: Vec<u64> = members.iter().map(|&e| load[e]).collect();
        let extra = redundant / groups + usize::from(g < redundant % groups);
        let local = balance_layer(&sub, per_group, extra);
        for (i, cards_of) in local.into_iter().enumerate() {
            holders[members[i]] = cards_of.into_iter().map(|c| g * per_group + c).collect();
        }
    }
    holders
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::{balancedness, card_loads};
    use proptest::prelude::*;

    #[test]
    fn each_group_gets_an_even_share_of_the_load_and_keeps_its_copies() {
        // Two hot experts: one to each group, each copied on both of its group's cards.
        let load = [900, 800, 10, 10, 10, 10, 10, 10];
        let holders = balance_layer_in_groups(&load, 4, 2, 2);
        let group = |c: usize| c / 2;
        assert_ne!(group(holders[0][0]), group(holders[1][0]), "{holders:?}");
        for (e, h) in holders.iter().enumerate() {
            assert!(
                h.iter().all(|&c| group(c) == group(h[0])),
                "expert {e}: {h:?}"
            );
        }
        assert_eq!((holders[0].len(), holders[1].len()), (2, 2), "{holders:?}");
        let loads = card_loads(&load, &holders, 4);
        assert!(balancedness(&loads) > 0.9, "{loads:?}");
    }

    proptest! {
        #[test]
        fn copies_stay_in_one_group_and_no_card_holds_more_than_its_share(
            load in prop::collection::vec(0u64..1000, 4..24),
            groups in 1usize..4,
            per_group in 1usize..4,
            redundant in 0usize..12,
        ) {
            let cards = groups * per_group;
            let holders = balance_layer_in_groups(&load, cards, groups, redundant);
            prop_assert_eq!(holders.len(), load.len());
            let mut held = vec![0usize; cards];
            for (e, h) in holders.iter().enumerate() {
                prop_assert!(!h.is_empty(), "expert {} has no copy", e);
                let mut sorted = h.clone();
                sorted.dedup();
                prop_assert_eq!(sorted.len(), h.len(), "two copies of {} on one card", e);
                if load.len() >= groups {
                    prop_assert!(h.iter().all(|&c| c / per_group == h[0] / per_group));
                }
                for &c in h {
                    prop_assert!(c < cards);
                    held[c] += 1;
                }
            }
            // The same input gives the same placement.
            prop_assert_eq!(&holders, &balance_layer_in_groups(&load, cards, groups, redundant));
            // Inside a group no card holds more than the group's even share of slots.
            for g in 0..groups {
                let counts = &held[g * per_group..(g + 1) * per_group];
                let slots = counts.iter().sum::<usize>().div_ceil(per_group);
                prop_assert!(counts.iter().all(|&n| n <= slots), "group {}: {:?}", g, counts);
            }
        }
    }
}
