//! Level 1 of the verification plan: the executor's output is bitwise equal to the software
//! model of the same program, whatever the tiling, thread count, kernel path, core placement
//! or card count.

use corsair_ffn::assignment::{LayerShare, PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, TilingOptions, compile};
use corsair_ffn::executor::{ExecOptions, KernelChoice, Slot};
use corsair_ffn::format::{FormatChoice, TileFormat};
use corsair_ffn::lm_head::RowSampling;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::reference::SoftwareModel;
use corsair_ffn::synthetic::{SplitMix, SyntheticWeights, gpt_oss_config, tiny_config};
use corsair_ffn::{Card, CardOptions};
use model::config::FfnKind;
use model::kernels::ActivationDtype;
use model::weights::WeightFormat;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    gpt_oss: bool,
    dense: bool,
    source: WeightFormat,
    choice: FormatChoice,
    rows_per_tile: Option<usize>,
    segments_per_tile: Option<usize>,
    threads: usize,
    kernel: KernelChoice,
    cards: usize,
    /// Cores per slice of the profile (changes how many cores tiles spread over).
    cores_per_slice: usize,
    tokens: usize,
    max_tokens: usize,
    seed: u64,
    /// What the card's products round their inputs to.
    activations: ActivationDtype,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            1usize..40,
            1usize..12,
            1usize..6,
            1usize..4,
            any::<bool>(),
            any::<bool>(),
        ),
        (
            0usize..3,
            0usize..4,
            prop::option::of(1usize..40),
            prop::option::of(1usize..3),
        ),
        (
            1usize..4,
            0usize..3,
            1usize..4,
            1usize..9,
            any::<u64>(),
            0usize..3,
        ),
    )
        .prop_map(
            |(
                (h, i, e, k, gpt, dense),
                (src, choice, rpt, spt),
                (threads, kernel, cards, tokens, seed, cores),
            )| {
                let source = [WeightFormat::F32, WeightFormat::Bf16, WeightFormat::Mxfp4][src];
                // MXFP4 checkpoints have whole blocks; other formats take any width.
                let (hidden, inter) = if source == WeightFormat::Mxfp4 {
                    (h * 32, i * 32)
                } else {
                    (h * 29 + 3, i * 17 + 1)
                };
                Case {
                    hidden,
                    inter,
                    experts: e,
                    top_k: k.min(e),
                    gpt_oss: gpt,
                    dense: dense && !gpt,
                    source,
                    choice: [
                        FormatChoice::AsStored,
                        FormatChoice::Bf16,
                        FormatChoice::Mxfp4,
                        FormatChoice::Mxint8,
                    ][choice],
                    rows_per_tile: rpt,
                    segments_per_tile: spt,
                    threads,
                    kernel: KernelChoice::ALL[kernel],
                    cards,
                    cores_per_slice: [1, 4, 32][cores],
                    tokens,
                    max_tokens: tokens + (seed % 3) as usize,
                    seed,
                    activations: ActivationDtype::F32,
                }
            },
        )
}

fn config(c: &Case) -> model::ModelConfig {
    let mut cfg = if c.gpt_oss {
        gpt_oss_config(1, c.experts, c.top_k, c.hidden, c.inter, 50)
    } else {
        let layers = if c.dense {
            vec![FfnKind::Dense, FfnKind::Moe]
        } else {
            vec![FfnKind::Moe]
        };
        tiny_config(c.experts, c.top_k, c.hidden, c.inter, &layers)
    };
    cfg.vocab_size = 37;
    cfg
}

fn random(n: usize, rng: &mut SplitMix) -> Vec<f32> {
    (0..n).map(|_| rng.symmetric()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every card of the deployment against the software model, layer by layer and the LM head.
fn check(c: &Case) -> Result<(), TestCaseError> {
    let cfg = config(c);
    let weights = SyntheticWeights::random(&cfg, c.source, c.seed, &|_, _| true);
    let stored = StoredFormats::uniform(TileFormat::from_stored(c.source));
    let stored = StoredFormats {
        dense: if c.source == WeightFormat::Mxfp4 {
            TileFormat::Bf16
        } else {
            stored.dense
        },
        lm_head: if c.source == WeightFormat::Mxfp4 {
            TileFormat::Bf16
        } else {
            stored.lm_head
        },
        ..stored
    };
    let options = CompileOptions {
        format: c.choice,
        max_tokens: c.max_tokens,
        tiling: TilingOptions {
            rows_per_tile: c.rows_per_tile,
            segments_per_tile: c.segments_per_tile,
        },
        activations: c.activations,
        ..CompileOptions::default()
    };
    let mut profile = HardwareProfile::default();
    profile.hierarchy.cores_per_slice = c.cores_per_slice;
    let plan = plan_placement(
        &cfg,
        &PlacementOptions {
            cards: c.cards,
            replicas: vec![],
        },
    )
    .unwrap();
    let mut rng = SplitMix::new(c.seed, 1);
    let x = random(c.tokens * c.hidden, &mut rng);
    for a in &plan {
        let program = compile(&cfg, &stored, a, &options, &profile)
            .unwrap()
            .program;
        // The compiler marks exactly the bf16 and MXFP4 matrices of whole blocks as bf16, or
        // under MXINT8 activations the MXFP4 and MXINT8 ones as MXINT8 and the bf16 ones as
        // bf16.
        for m in &program.matrices {
            let whole = m.cols % 32 == 0;
            let want = match (c.activations, m.format) {
                (_, _) if !whole => ActivationDtype::F32,
                (ActivationDtype::Mxint8, TileFormat::Mxfp4 | TileFormat::Mxint8) => {
                    ActivationDtype::Mxint8
                }
                (ActivationDtype::Mxint8 | ActivationDtype::Bf16, TileFormat::Bf16)
                | (ActivationDtype::Bf16, TileFormat::Mxfp4) => ActivationDtype::Bf16,
                _ => ActivationDtype::F32,
            };
            prop_assert_eq!(m.activations, want, "{}", m.name);
        }
        let reference = SoftwareModel::new(&program, &weights);
        let mut card = Card::new(
            program.clone(),
            &weights,
            CardOptions {
                exec: ExecOptions {
                    threads: c.threads,
                    kernel: c.kernel,
                    ..ExecOptions::default()
                },
                ..CardOptions::default()
            },
        )
        .unwrap();
        for (l, share) in a.layers.iter().enumerate() {
            match share {
                LayerShare::Moe { experts } => {
                    // Random distinct local experts per token (some slots empty), random weights.
                    let mut slots = Vec::with_capacity(c.tokens * c.top_k);
                    for _ in 0..c.tokens {
                        let mut pool: Vec<u32> = experts.clone();
                        for _ in 0..c.top_k {
                            let pick = (rng.next_u64() % (pool.len() as u64 + 1)) as usize;
                            slots.push(if pick < pool.len() {
                                Slot {
                                    expert: pool.swap_remove(pick),
                                    weight: rng.symmetric(),
                                }
                            } else {
                                Slot::EMPTY
                            });
                        }
                    }
                    let got = card.moe_layer(l, &x, &slots).unwrap();
                    let want = reference.moe_layer(l, &x, &slots).unwrap();
                    prop_assert_eq!(bits(&got), bits(&want), "card {} layer {}", a.card, l);
                }
                LayerShare::Dense { .. } => {
                    let got = card.dense_layer(l, &x).unwrap();
                    let want = reference.dense_layer(l, &x).unwrap();
                    prop_assert_eq!(bits(&got), bits(&want), "card {} dense layer {}", a.card, l);
                }
            }
        }
        if !a.lm_head_rows.is_empty() {
            let got = card.lm_head_logits(&x).unwrap();
            let want: Vec<f32> = x
                .chunks_exact(c.hidden)
                .flat_map(|row| reference.lm_logits(row).unwrap())
                .collect();
            prop_assert_eq!(bits(&got), bits(&want), "card {} LM head", a.card);
            let rows: Vec<RowSampling> = (0..c.tokens)
                .map(|t| RowSampling {
                    params: model::sampling::SamplingParams {
                        temperature: 0.7,
                        seed: c.seed,
                        ..Default::default()
                    },
                    position: t as u64,
                    logprobs: t % 2 == 0,
                    filtered: t % 3 == 0,
                    target: None,
                })
                .collect();
            let got = card.lm_head(&x, &rows).unwrap();
            let want = reference.lm_head(&x, &rows, &Default::default()).unwrap();
            prop_assert_eq!(got, want);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn executor_equals_software_model(c in case()) {
        check(&c)?;
    }

    /// The same with bf16 activations, widths made whole blocks so that every bf16 and MXFP4
    /// tile takes the bf16 order (the program says which matrices do; the software model
    /// follows it).
    #[test]
    fn executor_equals_software_model_with_bf16_activations(c in case()) {
        let c = Case {
            hidden: c.hidden.div_ceil(32) * 32,
            inter: c.inter.div_ceil(32) * 32,
            activations: ActivationDtype::Bf16,
            ..c
        };
        check(&c)?;
    }

    /// The same with MXINT8 activations: MXFP4 and MXINT8 tiles take the MXINT8 order, bf16
    /// tiles the bf16 order.
    #[test]
    fn executor_equals_software_model_with_mxint8_activations(c in case()) {
        let c = Case {
            hidden: c.hidden.div_ceil(32) * 32,
            inter: c.inter.div_ceil(32) * 32,
            activations: ActivationDtype::Mxint8,
            ..c
        };
        check(&c)?;
    }
}

/// The same expert computed as part of different card shares, tilings and thread counts gives
/// the same bits (one slot per token, so the partial sum is that expert's output alone).
#[test]
fn an_expert_is_the_same_on_any_card_count() {
    let cfg = gpt_oss_config(1, 6, 2, 64 * 11 + 32, 96, 50);
    let weights = SyntheticWeights::random(&cfg, WeightFormat::Mxfp4, 5, &|_, _| true);
    let stored = StoredFormats {
        experts: TileFormat::Mxfp4,
        ..StoredFormats::uniform(TileFormat::Bf16)
    };
    let profile = HardwareProfile::default();
    let mut rng = SplitMix::new(5, 2);
    let tokens = 5;
    let x = random(tokens * cfg.hidden_size, &mut rng);
    let expert = 4u32;
    let mut outputs = Vec::new();
    for (cards, rows_per_tile, segs, threads) in [
        (1, None, None, 1),
        (2, Some(7), Some(1), 2),
        (3, Some(33), Some(2), 3),
        (6, Some(1), None, 2),
    ] {
        let plan = plan_placement(
            &cfg,
            &PlacementOptions {
                cards,
                replicas: vec![],
            },
        )
        .unwrap();
        let a = plan.iter().find(|a| a.holds(0, expert as usize)).unwrap();
        let options = CompileOptions {
            max_tokens: 8,
            tiling: TilingOptions {
                rows_per_tile,
                segments_per_tile: segs,
            },
            ..CompileOptions::default()
        };
        let program = compile(&cfg, &stored, a, &options, &profile)
            .unwrap()
            .program;
        let mut card = Card::new(
            program,
            &weights,
            CardOptions {
                exec: ExecOptions {
                    threads,
                    kernel: KernelChoice::Auto,
                    ..ExecOptions::default()
                },
                ..Default::default()
            },
        )
        .unwrap();
        let slots: Vec<Slot> = (0..tokens)
            .flat_map(|_| {
                [
                    Slot {
                        expert,
                        weight: 1.0,
                    },
                    Slot::EMPTY,
                ]
            })
            .collect();
        outputs.push(bits(&card.moe_layer(0, &x, &slots).unwrap()));
    }
    assert!(outputs.windows(2).all(|w| w[0] == w[1]));
    assert!(outputs[0].iter().any(|&b| b != 0));
}

/// MXFP4 is the dequantized math exactly: a program over MXFP4 weights gives the same bits as
/// a program over their dequantized f32 values.
#[test]
fn mxfp4_equals_its_dequantized_f32_twin() {
    use corsair_ffn::synthetic::SyntheticLayer;
    let cfg = gpt_oss_config(1, 3, 2, 1024 + 64, 160, 40);
    let mxfp4 = SyntheticWeights::random(&cfg, WeightFormat::Mxfp4, 11, &|_, _| true);
    let mut twin = mxfp4.clone();
    for layer in &mut twin.layers {
        if let SyntheticLayer::Moe(experts) = layer {
            for mlp in experts.iter_mut().flatten() {
                for lin in [&mut mlp.gate, &mut mlp.up, &mut mlp.down] {
                    let w = &lin.weight;
                    lin.weight = model::WeightMatrix::from_f32(w.rows(), w.cols(), &w.to_f32());
                }
            }
        }
    }
    let profile = HardwareProfile::default();
    let plan = plan_placement(
        &cfg,
        &PlacementOptions {
            cards: 1,
            replicas: vec![],
        },
    )
    .unwrap();
    let options = CompileOptions {
        max_tokens: 4,
        ..CompileOptions::default()
    };
    let mut rng = SplitMix::new(11, 4);
    let x = random(4 * cfg.hidden_size, &mut rng);
    let slots: Vec<Slot> = (0..4)
        .flat_map(|t| {
            [
                Slot {
                    expert: t % 3,
                    weight: 0.7,
                },
                Slot {
                    expert: (t + 1) % 3,
                    weight: 0.3,
                },
            ]
        })
        .collect();
    let mut outs = Vec::new();
    for (weights, experts) in [(&mxfp4, TileFormat::Mxfp4), (&twin, TileFormat::F32)] {
        let stored = StoredFormats {
            experts,
            ..StoredFormats::uniform(TileFormat::Bf16)
        };
        let program = compile(&cfg, &stored, &plan[0], &options, &profile)
            .unwrap()
            .program;
        assert_eq!(program.matrices[0].format, experts);
        let mut card = Card::new(program, weights, CardOptions::default()).unwrap();
        outs.push(bits(&card.moe_layer(0, &x, &slots).unwrap()));
    }
    assert_eq!(outs[0], outs[1]);
}
