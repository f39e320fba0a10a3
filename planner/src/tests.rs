use corsair_ffn::HardwareProfile;
use corsair_ffn::compiler::StoredFormats;
use model::ModelConfig;

use super::*;

/// A named GPT-OSS shape (`afd synth --config-only`) and its stored formats.
pub(crate) fn shape(name: &str) -> (ModelConfig, StoredFormats) {
    named_shape(model::Family::GptOss, name).unwrap()
}

/// The built-in H100, Corsair and JetStream profiles.
pub(crate) fn builtin_profiles() -> Profiles {
    Profiles {
        device: DeviceProfile::builtin("h100").unwrap().unwrap(),
        card: HardwareProfile::default(),
        network: NetworkProfile::builtin("jetstream").unwrap().unwrap(),
    }
}

#[test]
fn cards_per_token_and_distinct_experts() {
    // One expert per token on a single card: every token goes to it.
    assert!((gpu::distinct_experts(32, 4, 1) - 4.0).abs() < 1e-9);
    assert!(gpu::distinct_experts(32, 4, 64) > 31.0);
    assert!(gpu::distinct_experts(32, 4, 64) <= 32.0);
}

mod properties {
    use std::sync::OnceLock;

    use corsair_ffn::assignment::PlacementOptions;
    use corsair_ffn::compiler::{CompileOptions, compile_deployment};
    use proptest::prelude::*;
    use step::MicroBatches;

    use super::*;

    const MAX_CARDS: usize = 4;

    /// The `small` GPT-OSS shape, its profiles and its cards compiled for 1..=4 cards.
    struct Fixture {
        config: ModelConfig,
        profiles: Profiles,
        sets: Vec<CardSet>,
    }

    fn fixture() -> &'static Fixture {
        static FIXTURE: OnceLock<Fixture> = OnceLock::new();
        FIXTURE.get_or_init(|| {
            let (config, stored) = shape("small");
            let profiles = builtin_profiles();
            let options = CompileOptions {
                max_tokens: 256,
                ..CompileOptions::default()
            };
            let sets = (1..=MAX_CARDS)
                .map(|cards| {
                    let placement = PlacementOptions {
                        cards,
                        replicas: vec![],
                    };
                    let programs =
                        compile_deployment(&config, &stored, &placement, &options, &profiles.card)
                            .unwrap()
                            .into_iter()
                            .map(|c| c.unwrap().program)
                            .collect();
                    CardSet::new(programs)
                })
                .collect();
            Fixture {
                config,
                profiles,
                sets,
            }
        })
    }

    fn system(f: &Fixture, cards: usize, nodes: usize, two: bool) -> System<'_> {
        System {
            model: &f.config,
            device: &f.profiles.device,
            network: &f.profiles.network,
            cards: (cards > 0).then(|| &f.sets[cards - 1]),
            nodes,
            micro_batches: if two {
                MicroBatches::Two
            } else {
                MicroBatches::One
            },
            wire_bytes: 2,
            chunk_tokens: 256,
            lm_head_candidates: 64,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn steps_are_positive_and_never_faster_at_longer_contexts(
            cards in 0..=MAX_CARDS,
            nodes in 1usize..=2,
            batch in 1usize..=64,
            context in 1usize..8192,
            extra in 0usize..8192,
            two in any::<bool>(),
        ) {
            let f = fixture();
            let s = system(f, cards, nodes, two);
            let short = s.step(batch, 1, context as f64);
            let long = s.step(batch, 1, (context + extra) as f64);
            prop_assert!(short.seconds.is_finite() && short.seconds > 0.0);
            prop_assert!(long.seconds >= short.seconds * (1.0 - 1e-12));
            prop_assert!(short.layers_seconds > 0.0 && short.lm_head_seconds >= 0.0);
        }

        #[test]
        fn doubling_the_batch_at_most_doubles_the_step(
            cards in 0..=MAX_CARDS,
            batch in 1usize..=32,
            context in 1usize..4096,
        ) {
            let f = fixture();
            let s = system(f, cards, 1, false);
            let one = s.step(batch, 1, context as f64).seconds;
            let two = s.step(2 * batch, 1, context as f64).seconds;
            prop_assert!(two >= one * (1.0 - 1e-12), "{two} < {one}");
            prop_assert!(two <= 2.0 * one * (1.0 + 1e-12), "{two} > 2 x {one}");
        }
    }
}

mod step_shapes {
    use corsair_ffn::assignment::PlacementOptions;
    use corsair_ffn::compiler::{CompileOptions, compile_deployment};
    use step::MicroBatches;

    use super::*;

    /// The `small` GPT-OSS shape on `cards` cards, one copy of each expert.
    fn cards(cards: usize) -> (ModelConfig, Profiles, CardSet) {
        let (config, stored) = shape("small");
        let profiles = builtin_profiles();
        let placement = PlacementOptions {
            cards,
            replicas: vec![],
        };
        let options = CompileOptions {
            max_tokens: 256,
            ..CompileOptions::default()
        };
        let programs = compile_deployment(&config, &stored, &placement, &options, &profiles.card)
            .unwrap()
            .into_iter()
            .map(|c| c.unwrap().program)
            .collect();
        (config, profiles, CardSet::new(programs))
    }

    fn system<'a>(config: &'a ModelConfig, p: &'a Profiles, set: &'a CardSet) -> System<'a> {
        System {
            model: config,
            device: &p.device,
            network: &p.network,
            cards: Some(set),
            nodes: 1,
            micro_batches: MicroBatches::One,
            wire_bytes: 2,
            chunk_tokens: 256,
            lm_head_candidates: 64,
        }
    }

    /// A decode batch described sequence by sequence, every sequence at the same context, is
    /// timed as the planner's uniform batch at that context: one step model, two descriptions.
    #[test]
    fn spans_of_equal_decodes_time_as_the_uniform_batch() {
        let (config, p, set) = cards(4);
        let s = system(&config, &p, &set);
        for (batch, context) in [(1, 1024), (7, 129), (32, 4000)] {
            let spans: Vec<Span> = (0..batch)
                .map(|_| Span {
                    new: 1,
                    past: context - 1,
                })
                .collect();
            let exact = s.step_time(&StepShape {
                micro_batches: vec![MicroBatchShape {
                    group: TokenGroup {
                        tokens: batch,
                        sequences: batch,
                        attending: Attending::Spans(&spans),
                    },
                    routing: Routing::Expected,
                }],
                sample_rows: batch,
                nodes: 1,
            });
            let uniform = s.step(batch, 1, context as f64);
            let rel = (exact.time.seconds - uniform.seconds).abs() / uniform.seconds;
            assert!(
                rel < 1e-9,
                "batch {batch}: {} vs {}",
                exact.time.seconds,
                uniform.seconds
            );
            assert_eq!(exact.layers.len(), config.num_layers());
        }
    }

    /// Observed routing: the same rows all on one card take longer than spread over the cards,
    /// the busy card's own time says so, and a card sent nothing has no busy time.
    #[test]
    fn a_hot_card_sets_the_pace() {
        let (config, p, set) = cards(4);
        let s = system(&config, &p, &set);
        let layers = config.num_layers();
        let tokens = 16;
        let k = config.moe.unwrap().top_k;
        let rows_on = |card: usize, rows: usize| CardRows {
            card,
            rows,
            expert_rows: {
                let local = set.local_experts_of(card, 0).len();
                let mut r = vec![0; local];
                // Spread this card's token-expert pairs over its experts.
                for i in 0..rows * k {
                    r[i % local] += 1;
                }
                r.iter_mut().for_each(|x| *x = (*x).min(rows));
                r
            },
        };
        let spread: Vec<Vec<CardRows>> = (0..layers)
            .map(|_| (0..4).map(|c| rows_on(c, tokens / 4)).collect())
            .collect();
        let hot: Vec<Vec<CardRows>> = (0..layers).map(|_| vec![rows_on(2, tokens)]).collect();
        let spans: Vec<Span> = (0..tokens).map(|_| Span { new: 1, past: 99 }).collect();
        let time = |load: &[Vec<CardRows>]| {
            s.step_time(&StepShape {
                micro_batches: vec![MicroBatchShape {
                    group: TokenGroup {
                        tokens,
                        sequences: tokens,
                        attending: Attending::Spans(&spans),
                    },
                    routing: Routing::Observed(load),
                }],
                sample_rows: tokens,
                nodes: 1,
            })
        };
        let (even, skewed) = (time(&spread), time(&hot));
        assert!(
            skewed.time.card_per_layer > even.time.card_per_layer,
            "{} vs {}",
            skewed.time.card_per_layer,
            even.time.card_per_layer
        );
        let busy = &skewed.time.card_busy_seconds;
        assert_eq!(busy.len(), 4);
        assert!(
            busy[2] > 0.0 && busy[0] == 0.0 && busy[1] == 0.0 && busy[3] == 0.0,
            "{busy:?}"
        );
        assert!(even.time.card_busy_seconds.iter().all(|&b| b > 0.0));
        // One micro-batch hides nothing.
        assert_eq!(even.time.overlap_hidden_seconds, 0.0);
        assert!(even.time.device_idle_seconds > 0.0);
    }

    /// Keys read and attended, span by span, with and without a window.
    #[test]
    fn spans_count_keys_under_a_window() {
        let spans = [Span { new: 3, past: 4 }, Span { new: 1, past: 0 }];
        let g = TokenGroup {
            tokens: 4,
            sequences: 2,
            attending: Attending::Spans(&spans),
        };
        // Tokens at positions 4, 5, 6 attend to 5, 6, 7 keys; the lone token to 1.
        assert_eq!(g.keys(None), (7.0 + 1.0, 5.0 + 6.0 + 7.0 + 1.0));
        // A window of 6 caps the third token at 6 keys and the first sequence's read at 6.
        assert_eq!(g.keys(Some(6)), (6.0 + 1.0, 5.0 + 6.0 + 6.0 + 1.0));
    }
}
