//! The reference forward against the transformers fixtures in `fixtures/`: every prompt's
//! logits within 1e-4, every greedy continuation equal, cached decode equal to a full
//! recompute, and the tokenizer reproducing the recorded ids.

use std::path::{Path, PathBuf};

use model::forward::{LogitsFor, ReferenceModel, SeqChunk};
use model::generate::{GenerationRequest, generate};
use model::sampling::SamplingParams;
use model::{ModelTokenizer, ModelWeights};
use safetensors::SafeTensors;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn fixture_dirs() -> Vec<PathBuf> {
    let dirs = model::test_support::fixture_dirs().unwrap();
    assert!(
        dirs.len() >= 4,
        "expected the committed fixtures under {}",
        model::test_support::fixtures_root().display()
    );
    dirs
}

struct Fixture {
    name: String,
    expected: Value,
    logits: Vec<u8>,
}

impl Fixture {
    fn load(dir: &Path) -> Self {
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        Fixture {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            expected,
            logits: std::fs::read(dir.join("expected_logits.safetensors")).unwrap(),
        }
    }

    fn tensor(&self, name: &str) -> Option<(Vec<usize>, Vec<f32>)> {
        let st = SafeTensors::deserialize(&self.logits).unwrap();
        let t = st.tensor(name).ok()?;
        let values = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some((t.shape().to_vec(), values))
    }

    fn prompts(&self) -> Vec<(Vec<u32>, Vec<u32>)> {
        self.expected["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (ids(&p["ids"]), ids(&p["output_ids"])))
            .collect()
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn prompt_logits_match_transformers() {
    for dir in fixture_dirs() {
        let f = Fixture::load(&dir);
        let mut model = ReferenceModel::new(ModelWeights::load(&dir).unwrap()).unwrap();
        let mut worst = 0f32;
        for (i, (prompt, _)) in f.prompts().iter().enumerate() {
            let (shape, expected) = f.tensor(&format!("prompt_{i}")).unwrap();
            assert_eq!(shape[0], prompt.len());
            let chunk = SeqChunk {
                seq: i as u64,
                tokens: prompt.clone(),
            };
            let got = model
                .forward(&[chunk], LogitsFor::AllTokens)
                .unwrap()
                .remove(0);
            let diff = max_abs_diff(&got, &expected);
            assert!(
                diff <= TOLERANCE,
                "{} prompt {i}: max |logit diff| {diff} > {TOLERANCE}",
                f.name
            );
            worst = worst.max(diff);
            model.free(i as u64);
        }
        eprintln!("{}: largest prompt logit difference {worst:.2e}", f.name);
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for dir in fixture_dirs() {
        let f = Fixture::load(&dir);
        let mut model = ReferenceModel::new(ModelWeights::load(&dir).unwrap()).unwrap();
        let prompts = f.prompts();
        // All prompts of the fixture in one batch: batching must not change any sequence.
        let requests: Vec<GenerationRequest> = prompts
            .iter()
            .map(|(p, out)| GenerationRequest {
                prompt: p.clone(),
                max_tokens: out.len(),
                sampling: SamplingParams::greedy(),
                stop_token_ids: Vec::new(),
            })
            .collect();
        let generations = generate(&mut model, &requests, 100).unwrap();
        for (i, (g, (_, expected))) in generations.iter().zip(&prompts).enumerate() {
            assert_eq!(&g.output_ids, expected, "{} prompt {i}", f.name);
        }
    }
}

#[test]
fn cached_decode_matches_transformers_steps_and_full_recompute() {
    let mut checked = 0;
    for dir in fixture_dirs() {
        let f = Fixture::load(&dir);
        let mut model = ReferenceModel::new(ModelWeights::load(&dir).unwrap()).unwrap();
        for (i, (prompt, output)) in f.prompts().iter().enumerate() {
            let Some((shape, steps)) = f.tensor(&format!("steps_{i}")) else {
                continue;
            };
            checked += 1;
            let vocab = shape[1];
            // Cached: the prompt, then one token at a time; row s chose output[s].
            let seq = 1000 + i as u64;
            let step = |model: &mut ReferenceModel, tokens: Vec<u32>| {
                model
                    .forward(&[SeqChunk { seq, tokens }], LogitsFor::LastToken)
                    .unwrap()
                    .remove(0)
            };
            let mut cached = step(&mut model, prompt.clone());
            for s in 0..output.len() {
                let diff = max_abs_diff(&cached, &steps[s * vocab..(s + 1) * vocab]);
                assert!(
                    diff <= TOLERANCE,
                    "{} prompt {i} step {s}: cached decode differs by {diff}",
                    f.name
                );
                if s + 1 < output.len() {
                    cached = step(&mut model, vec![output[s]]);
                }
            }
            model.free(seq);
            // Full recompute of prompt + continuation in one forward, without a cache.
            let mut all = prompt.clone();
            all.extend_from_slice(&output[..output.len() - 1]);
            let full = model
                .forward(&[SeqChunk { seq, tokens: all }], LogitsFor::AllTokens)
                .unwrap()
                .remove(0);
            let diff = max_abs_diff(&full[(prompt.len() - 1) * vocab..], &steps);
            assert!(
                diff <= TOLERANCE,
                "{} prompt {i}: full recompute differs by {diff}",
                f.name
            );
            model.free(seq);
        }
    }
    assert!(checked >= 4, "the fixtures should carry step logits");
}

#[test]
fn rope_inv_freq_matches_transformers() {
    for dir in fixture_dirs() {
        let f = Fixture::load(&dir);
        let config = model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let (_, expected) = f.tensor("inv_freq").unwrap();
        let ours = config.rope.inv_freq(config.head_dim);
        assert_eq!(ours.len(), expected.len());
        for (a, b) in ours.iter().zip(&expected) {
            assert!(
                ((a - b) / b).abs() < 1e-6,
                "{}: inv_freq {a} vs {b}",
                f.name
            );
        }
    }
}

#[test]
fn tokenizers_reproduce_recorded_prompt_ids() {
    let mut checked = 0;
    for dir in fixture_dirs() {
        let f = Fixture::load(&dir);
        let tok = ModelTokenizer::load(&dir).unwrap();
        assert!(
            tok.chat_template.is_some(),
            "{}: no chat template found",
            f.name
        );
        for p in f.expected["prompts"].as_array().unwrap() {
            if p["kind"] != "text" {
                continue;
            }
            let text = p["text"].as_str().unwrap();
            let add = p["add_special_tokens"].as_bool().unwrap_or(true);
            assert_eq!(
                tok.encode(text, add).unwrap(),
                ids(&p["ids"]),
                "{}: {text:?}",
                f.name
            );
            checked += 1;
        }
    }
    assert!(checked >= 4);
}

#[test]
fn every_checkpoint_tensor_is_indexed_with_its_shape() {
    for dir in fixture_dirs() {
        let f = Fixture::load(&dir);
        let ck = model::checkpoint::Checkpoint::open(&dir).unwrap();
        let tensors = f.expected["tensors"].as_object().unwrap();
        for (name, info) in tensors {
            let t = ck.get(name).unwrap();
            let shape: Vec<usize> = info["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(t.shape, shape, "{}: {name}", f.name);
        }
        assert_eq!(ck.names().len(), tensors.len(), "{}", f.name);
    }
}
