//! Every fixture (tiny checkpoints made by Hugging Face transformers) compiles and passes the
//! sanitizer on 1-3 cards in every format, and the cards reproduce the model crate's reference
//! expert, dense and LM-head math within 1e-5 relative.

use std::path::{Path, PathBuf};

use corsair_ffn::assignment::{LayerShare, PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile};
use corsair_ffn::executor::Slot;
use corsair_ffn::format::FormatChoice;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::reference::SoftwareModel;
use corsair_ffn::synthetic::SplitMix;
use corsair_ffn::{Card, CardOptions};
use model::config::Activation;
use model::forward::moe::{gated_mlp, moe_forward, route};
use model::weights::FfnWeights;
use model::{ModelConfig, ModelWeights};

fn fixtures() -> Vec<PathBuf> {
    let dirs = model::test_support::fixture_dirs().unwrap();
    let root = model::test_support::fixtures_root();
    assert!(dirs.len() >= 6, "fixtures missing in {}", root.display());
    dirs
}

fn stored(dir: &Path, cfg: &ModelConfig) -> StoredFormats {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    StoredFormats::from_config_json(&text, cfg).unwrap()
}

/// Largest |a - b| over the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix::new(seed, 3);
    (0..n).map(|_| rng.symmetric()).collect()
}

#[test]
fn every_fixture_compiles_clean_on_one_to_three_cards_in_every_format() {
    let profile = HardwareProfile::default();
    for dir in fixtures() {
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let stored = stored(&dir, &cfg);
        for cards in 1..=3 {
            let plan = plan_placement(
                &cfg,
                &PlacementOptions {
                    cards,
                    replicas: vec![],
                },
            )
            .unwrap();
            for format in [
                FormatChoice::AsStored,
                FormatChoice::Bf16,
                FormatChoice::Mxfp4,
                FormatChoice::Mxint8,
            ] {
                for a in &plan {
                    let options = CompileOptions {
                        format,
                        ..CompileOptions::default()
                    };
                    let c = compile(&cfg, &stored, a, &options, &profile).unwrap_or_else(|e| {
                        panic!("{} on {cards} cards ({format}): {e}", dir.display())
                    });
                    assert!(c.sanitizer.is_clean());
                    assert_eq!(c.sanitizer.instructions, c.program.instructions.len());
                }
            }
        }
    }
}

/// The cards of a 2-card deployment, with the fixture's real weights.
fn cards(dir: &Path, weights: &ModelWeights, format: FormatChoice) -> Vec<Card> {
    let cfg = &weights.config;
    let plan = plan_placement(
        cfg,
        &PlacementOptions {
            cards: 2,
            replicas: vec![],
        },
    )
    .unwrap();
    let options = CompileOptions {
        format,
        max_tokens: 8,
        ..CompileOptions::default()
    };
    plan.iter()
        .map(|a| {
            let program = compile(
                cfg,
                &stored(dir, cfg),
                a,
                &options,
                &HardwareProfile::default(),
            )
            .unwrap()
            .program;
            Card::new(program, weights, CardOptions::default()).unwrap()
        })
        .collect()
}

#[test]
fn cards_match_the_reference_expert_dense_and_lm_head_math() {
    for dir in fixtures() {
        let weights = ModelWeights::load(&dir).unwrap();
        let cfg = weights.config.clone();
        let h = cfg.hidden_size;
        let n = 3;
        let mut cards = cards(&dir, &weights, FormatChoice::AsStored);
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        for (l, layer) in weights.layers.iter().enumerate() {
            let x = random(n * h, l as u64);
            match &layer.ffn {
                FfnWeights::Moe(moe) => {
                    let spec = cfg.moe.unwrap();
                    // Each expert alone (one slot of weight 1) against the reference gated MLP.
                    for e in 0..spec.num_experts {
                        let want = gated_mlp(moe.expert(e).unwrap(), spec.activation, &x, n);
                        let card = cards
                            .iter_mut()
                            .find(|c| c.program().assignment.holds(l, e))
                            .unwrap();
                        let mut slots = vec![Slot::EMPTY; n * spec.top_k];
                        for t in 0..n {
                            slots[t * spec.top_k] = Slot {
                                expert: e as u32,
                                weight: 1.0,
                            };
                        }
                        let got = card.moe_layer(l, &x, &slots).unwrap();
                        let err = rel_err(&got, &want);
                        assert!(
                            err <= 1e-5,
                            "{name} layer {l} expert {e}: relative error {err}"
                        );
                    }
                    // The whole layer: routed by the reference router, partials summed by card.
                    let routing = route(&moe.router, &spec, &x, n);
                    let mut sum = vec![0f32; n * h];
                    for card in cards.iter_mut() {
                        let slots: Vec<Slot> = routing
                            .experts
                            .iter()
                            .zip(&routing.weights)
                            .map(|(&e, &w)| {
                                if card.program().assignment.holds(l, e as usize) {
                                    Slot {
                                        expert: e,
                                        weight: w,
                                    }
                                } else {
                                    Slot::EMPTY
                                }
                            })
                            .collect();
                        for (s, v) in sum.iter_mut().zip(card.moe_layer(l, &x, &slots).unwrap()) {
                            *s += v;
                        }
                    }
                    let want = moe_forward(moe, &spec, &x, n, h).unwrap();
                    let err = rel_err(&sum, &want);
                    assert!(err <= 1e-5, "{name} layer {l}: MoE relative error {err}");
                }
                FfnWeights::Dense(mlp) => {
                    let want = gated_mlp(mlp, Activation::SwiGlu, &x, n);
                    let mut sum = vec![0f32; n * h];
                    for card in cards.iter_mut() {
                        for (s, v) in sum.iter_mut().zip(card.dense_layer(l, &x).unwrap()) {
                            *s += v;
                        }
                    }
                    let err = rel_err(&sum, &want);
                    assert!(err <= 1e-5, "{name} dense layer {l}: relative error {err}");
                }
            }
        }
        // LM head: the shards' logits side by side are the reference logits.
        let x = random(n * h, 99);
        let mut want = vec![0f32; n * cfg.vocab_size];
        model::kernels::matmul(&x, n, &weights.lm_head, None, &mut want);
        let mut got = vec![0f32; n * cfg.vocab_size];
        for card in cards.iter_mut() {
            let rows = card.program().assignment.lm_head_rows;
            let shard = card.lm_head_logits(&x).unwrap();
            for t in 0..n {
                got[t * cfg.vocab_size + rows.start..t * cfg.vocab_size + rows.end]
                    .copy_from_slice(&shard[t * rows.len()..(t + 1) * rows.len()]);
            }
        }
        let err = rel_err(&got, &want);
        assert!(err <= 1e-5, "{name} LM head: relative error {err}");
    }
}

#[test]
fn converted_formats_run_bit_exact_against_the_software_model_on_real_weights() {
    for dir in fixtures()
        .into_iter()
        .filter(|d| d.ends_with("gpt-oss-mxfp4") || d.ends_with("qwen3-moe"))
    {
        let weights = ModelWeights::load(&dir).unwrap();
        let cfg = weights.config.clone();
        let h = cfg.hidden_size;
        let x = random(4 * h, 5);
        for format in [
            FormatChoice::AsStored,
            FormatChoice::Bf16,
            FormatChoice::Mxfp4,
            FormatChoice::Mxint8,
        ] {
            for mut card in cards(&dir, &weights, format) {
                let program = card.program().clone();
                let model = SoftwareModel::new(&program, &weights);
                for (l, share) in program.assignment.layers.iter().enumerate() {
                    let (got, want) = match share {
                        LayerShare::Moe { experts } => {
                            let k = cfg.moe.unwrap().top_k;
                            let slots: Vec<Slot> = (0..4 * k)
                                .map(|i| match experts.get(i % k) {
                                    Some(&e) => Slot {
                                        expert: e,
                                        weight: 0.5 + i as f32 * 0.01,
                                    },
                                    None => Slot::EMPTY,
                                })
                                .collect();
                            (
                                card.moe_layer(l, &x, &slots).unwrap(),
                                model.moe_layer(l, &x, &slots).unwrap(),
                            )
                        }
                        LayerShare::Dense { .. } => (
                            card.dense_layer(l, &x).unwrap(),
                            model.dense_layer(l, &x).unwrap(),
                        ),
                    };
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{} {format} layer {l}",
                        dir.display()
                    );
                }
            }
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn binding_a_shard_drops_its_checkpoint_pages_from_the_page_tables() {
    let (mut pages, mut present) = (0, 0);
    for dir in fixtures() {
        let weights = ModelWeights::load(&dir).unwrap();
        let cfg = &weights.config;
        let Some(spec) = cfg.moe else { continue };
        let plan = plan_placement(
            cfg,
            &PlacementOptions {
                cards: 1,
                replicas: vec![],
            },
        )
        .unwrap();
        let program = compile(
            cfg,
            &stored(&dir, cfg),
            &plan[0],
            &CompileOptions {
                max_tokens: 8,
                ..CompileOptions::default()
            },
            &HardwareProfile::default(),
        )
        .unwrap()
        .program;
        let _card = Card::new(program, &weights, CardOptions::default()).unwrap();
        for layer in &weights.layers {
            let FfnWeights::Moe(moe) = &layer.ffn else {
                continue;
            };
            for e in 0..spec.num_experts {
                let mlp = moe.expert(e).unwrap();
                for m in [&mlp.gate.weight, &mlp.up.weight, &mlp.down.weight] {
                    // Some layouts are transposed at load: those copies are not the file's.
                    if !m.is_mapped() {
                        continue;
                    }
                    for bytes in [m.rows_from(0).0, m.scales_from(0).0] {
                        let (p, q) = model::test_support::mapped_pages(bytes);
                        pages += p;
                        present += q;
                    }
                }
            }
        }
    }
    assert!(pages > 0, "the fixtures' experts span no whole page");
    assert_eq!(present, 0, "pages of bound experts still mapped in");
}
