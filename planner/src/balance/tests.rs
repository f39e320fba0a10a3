use super::*;
use corsair_ffn::assignment::{PlacementOptions, plan_placement};
use proptest::prelude::*;

#[test]
fn balancedness_is_the_mean_card_load_over_the_largest() {
    assert_eq!(balancedness(&[3.0, 3.0, 3.0]), 1.0);
    assert_eq!(balancedness(&[2.0, 0.0]), 0.5);
    assert_eq!(balancedness(&[4.0, 2.0, 0.0, 2.0]), 0.5);
    assert_eq!(balancedness(&[0.0, 0.0]), 1.0);
}

#[test]
fn a_replicated_experts_tokens_count_evenly_on_its_holders() {
    let loads = card_loads(&[8, 2, 4], &[vec![0, 1], vec![1], vec![0, 1]], 2);
    assert_eq!(loads, vec![4.0 + 2.0, 4.0 + 2.0 + 2.0]);
}

/// Loads 8, 7, 6, 5, 4, 1 on two cards of three slots: greedy packing (heaviest first onto the
/// lighter card) makes {8, 5, 4} = 17 and {7, 6, 1} = 14; an exchange reaches the best split,
/// 16 and 15.
#[test]
fn refinement_finds_the_even_split_greedy_packing_misses() {
    let load = [8u64, 7, 6, 5, 4, 1];
    let greedy = layer_placement(&load, 2, 0, false);
    let refined = layer_placement(&load, 2, 0, true);
    let peak = |h: &LayerHolders| card_loads(&load, h, 2).into_iter().fold(0.0, f64::max);
    assert_eq!(
        peak(&refined),
        16.0,
        "31 tokens split 16 and 15: {refined:?}"
    );
    assert_eq!(peak(&greedy), 17.0, "{greedy:?}");
}

#[test]
fn one_hot_expert_gets_a_copy_on_every_card_and_the_cards_even_out() {
    // Expert 0 takes most of the layer: in the default placement its card does the most work.
    let load = [700, 10, 10, 10, 10, 10, 10, 10];
    let contiguous: LayerHolders = (0..8).map(|e| vec![e / 2]).collect();
    let before = balancedness(&card_loads(&load, &contiguous, 4));
    assert!(before < 0.3, "{before}");
    // Three extra copies all go to expert 0 (175 tokens a copy is still the most).
    let holders = balance_layer(&load, 4, 3);
    assert_eq!(holders[0], vec![0, 1, 2, 3]);
    assert!(holders[1..].iter().all(|h| h.len() == 1));
    let after = balancedness(&card_loads(&load, &holders, 4));
    assert!(after > 0.95, "{after}");
    // Without copies, and two slots a card, the hot expert's card takes one light expert more.
    let alone = balance_layer(&load, 4, 0);
    let loads = card_loads(&load, &alone, 4);
    assert_eq!(loads.iter().copied().fold(0.0, f64::max), 710.0);
}

#[test]
fn even_load_on_a_divisible_layer_is_perfectly_balanced() {
    let holders = balance_layer(&[5; 12], 4, 0);
    assert_eq!(balancedness(&card_loads(&[5; 12], &holders, 4)), 1.0);
    assert!(holders.iter().all(|h| h.len() == 1));
}

#[test]
fn the_placement_becomes_each_cards_share() {
    let (config, _) = crate::named_shape(model::Family::GptOss, "tiny").unwrap();
    let experts = config.moe.unwrap().num_experts;
    let default = plan_placement(
        &config,
        &PlacementOptions {
            cards: 3,
            replicas: vec![],
        },
    )
    .unwrap();
    let load = ExpertLoad {
        layers: config
            .moe_layers()
            .iter()
            .enumerate()
            .map(|(l, &moe)| {
                if moe {
                    (0..experts as u64)
                        .map(|e| (e * 7 + l as u64) % 11)
                        .collect()
                } else {
                    vec![]
                }
            })
            .collect(),
    };
    let placed = balance(&config, &load, &default, 2, 1).unwrap();
    assert_eq!(placed.before.len(), placed.after.len());
    let shares = placed.assignments(&default);
    for (layer, holders) in placed.layers.iter().enumerate() {
        match holders {
            Some(h) => assert_eq!(&holders_of(&shares, layer, experts), h, "layer {layer}"),
            None => {
                for (new, old) in shares.iter().zip(&default) {
                    assert_eq!(new.layers[layer], old.layers[layer]);
                }
            }
        }
    }
    for (new, old) in shares.iter().zip(&default) {
        assert_eq!(new.lm_head_rows, old.lm_head_rows);
        new.validate(&config).unwrap();
    }
    // A load of another model's shape is refused, saying so.
    let short = ExpertLoad {
        layers: load.layers[1..].to_vec(),
    };
    let err = balance(&config, &short, &default, 2, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("measure the load of the same model"), "{err}");
}

proptest! {
    /// Every expert is held, each copy on a different card, the copies asked for are placed
    /// (as many as the cards allow), every card holds the same number of copies give or take
    /// one, and the same load always gives the same placement.
    #[test]
    fn a_placement_by_load_is_complete_distinct_even_and_deterministic(
        load in prop::collection::vec(0u64..1000, 1..24),
        cards in 1usize..9,
        redundant in 0usize..20,
    ) {
        let holders = balance_layer(&load, cards, redundant);
        prop_assert_eq!(holders.len(), load.len());
        let mut held = vec![0usize; cards];
        for h in &holders {
            prop_assert!(!h.is_empty());
            prop_assert!(h.windows(2).all(|w| w[0] < w[1]), "{:?}", h);
            for &c in h {
                prop_assert!(c < cards);
                held[c] += 1;
            }
        }
        let total: usize = held.iter().sum();
        prop_assert_eq!(total, load.len() + redundant.min(load.len() * (cards - 1)));
        let slots = total.div_ceil(cards);
        prop_assert!(held.iter().all(|&h| h <= slots), "{:?} with {} slots", held, slots);
        prop_assert_eq!(balance_layer(&load, cards, redundant), holders);
    }

    /// On any load, with any number of copies, every layer ends at least as even as under the
    /// contiguous placement it replaces.
    #[test]
    fn a_placement_by_load_is_never_less_even_than_the_one_it_replaces(
        seed in any::<u64>(),
        cards in 1usize..6,
        redundant in 0usize..8,
        grouped in any::<bool>(),
    ) {
        // In two groups where the cards divide (hierarchical), else one.
        let groups = if grouped && cards % 2 == 0 { 2 } else { 1 };
        let (config, _) = crate::named_shape(model::Family::GptOss, "tiny").unwrap();
        let experts = config.moe.unwrap().num_experts;
        let default = plan_placement(&config, &PlacementOptions { cards, replicas: vec![] }).unwrap();
        let mut x = seed | 1;
        let load = ExpertLoad {
            layers: config
                .moe_layers()
                .iter()
                .map(|&moe| {
                    (0..if moe { experts } else { 0 })
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            x % 1000
                        })
                        .collect()
                })
                .collect(),
        };
        let placed = balance(&config, &load, &default, redundant, groups).unwrap();
        for (b, a) in placed.before.iter().zip(&placed.after) {
            prop_assert!(a >= b, "{} -> {}", b, a);
        }
        // And what it reports is what its holders give.
        let shares = placed.assignments(&default);
        let mut moe_layer = 0;
        for (layer, counts) in load.layers.iter().enumerate() {
            if counts.is_empty() {
                continue;
            }
            let got = balancedness(&card_loads(counts, &holders_of(&shares, layer, experts), cards));
            prop_assert!((got - placed.after[moe_layer]).abs() < 1e-12);
            moe_layer += 1;
        }
    }

    /// The refinements only ever lower the most loaded card, keep the number of copies, and
    /// leave every copy on a distinct card within the slots.
    #[test]
    fn refining_never_raises_the_peak_and_keeps_the_copies(
        load in prop::collection::vec(0u64..1000, 1..24),
        cards in 1usize..9,
        redundant in 0usize..20,
    ) {
        let greedy = layer_placement(&load, cards, redundant, false);
        let refined = layer_placement(&load, cards, redundant, true);
        let peak = |h: &LayerHolders| card_loads(&load, h, cards).into_iter().fold(0.0, f64::max);
        prop_assert!(peak(&refined) <= peak(&greedy) + 1e-9, "{} > {}", peak(&refined), peak(&greedy));
        let copies = |h: &LayerHolders| h.iter().map(Vec::len).sum::<usize>();
        prop_assert_eq!(copies(&refined), copies(&greedy));
        prop_assert!(refined.iter().all(|h| !h.is_empty()), "every expert keeps a copy");
        let slots = refined.iter().map(Vec::len).sum::<usize>().div_ceil(cards);
        let mut held = vec![0usize; cards];
        for h in &refined {
            prop_assert!(h.windows(2).all(|w| w[0] < w[1]), "{:?}", h);
            for &c in h {
                held[c] += 1;
            }
        }
        prop_assert!(held.iter().all(|&n| n <= slots), "{:?}", held);
    }

    /// Without copies, the packing (heaviest first, each to the least-loaded card with a slot)
    /// leaves no card more than the heaviest expert above the mean load.
    #[test]
    fn without_copies_no_card_exceeds_the_mean_by_more_than_the_heaviest_expert(
        load in prop::collection::vec(0u64..1000, 1..24),
        cards in 1usize..9,
    ) {
        let holders = balance_layer(&load, cards, 0);
        let loads = card_loads(&load, &holders, cards);
        let mean = load.iter().sum::<u64>() as f64 / cards as f64;
        let heaviest = load.iter().copied().max().unwrap_or(0) as f64;
        let max = loads.iter().copied().fold(0.0, f64::max);
        prop_assert!(max <= mean + heaviest + 1e-9, "{:?} (mean {}, heaviest {})", loads, mean, heaviest);
    }
}

/// On the `small` GPT-OSS shape over 4 cards, routing skewed onto the experts of card 0 makes
/// it the slowest card of every layer; the placement by load (with copies) spreads those
/// experts and the cards' modeled decode step gets shorter.
#[test]
fn the_placement_by_load_shortens_the_modeled_step_of_a_skewed_load() {
    use corsair_ffn::HardwareProfile;
    use corsair_ffn::compiler::{CompileOptions, compile};

    let (config, stored) = crate::named_shape(model::Family::GptOss, "small").unwrap();
    let moe = config.moe.unwrap();
    let (experts, cards) = (moe.num_experts, 4);
    let options = CompileOptions {
        max_tokens: 64,
        ..CompileOptions::default()
    };
    let profile = HardwareProfile::default();
    let card_set = |shares: &[CardAssignment]| {
        CardSet::new(
            shares
                .iter()
                .map(|a| {
                    compile(&config, &stored, a, &options, &profile)
                        .unwrap()
                        .program
                })
                .collect(),
        )
    };
    let default = plan_placement(
        &config,
        &PlacementOptions {
            cards,
            replicas: vec![],
        },
    )
    .unwrap();
    // Card 0's experts (the first quarter) take 90% of the tokens.
    let hot = experts / cards;
    let counts: Vec<u64> = (0..experts as u64)
        .map(|e| if (e as usize) < hot { 900 } else { 33 })
        .collect();
    let load = ExpertLoad {
        layers: config
            .moe_layers()
            .iter()
            .map(|&m| if m { counts.clone() } else { vec![] })
            .collect(),
    };
    let before_set = card_set(&default);
    let skewed = expected_layer_under_load(&before_set, 0, 16, &counts);
    let slowest_card = (0..cards)
        .max_by(|&a, &b| {
            skewed.per_card[a]
                .seconds
                .total_cmp(&skewed.per_card[b].seconds)
        })
        .unwrap();
    assert_eq!(slowest_card, 0, "{:?}", skewed.per_card);

    // Enough copies for a copy of each hot expert on every card.
    let placed = balance(&config, &load, &default, hot * (cards - 1), 1).unwrap();
    assert!(placed.mean_before() < 0.5, "{:?}", placed.before);
    assert!(placed.mean_after() > 0.9, "{:?}", placed.after);
    let after_set = card_set(&placed.assignments(&default));
    let before = cards_step_seconds(&before_set, &load, 16);
    let after = cards_step_seconds(&after_set, &load, 16);
    assert!(after < before * 0.9, "{after} s against {before} s");
}
