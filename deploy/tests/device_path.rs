//! The attention node's device path (what `--device cuda` runs: candle tensors, the paged KV
//! cache in device memory, the custom ops) on candle's CPU device, through the disaggregated
//! pipeline with real card programs over JetStream, against the transformers fixtures: greedy
//! tokens equal, the logits that chose them within 1e-4, and the fast CPU path's logits.

use std::path::Path;

use gpu_attention::{AttentionDevice, DisaggregatedNode, driver};
use model::generate::GenerationRequest;
use model::sampling::SamplingParams;
use safetensors::SafeTensors;

mod common;

use common::{embedded_node as node, expected, fixtures, greedy_requests};

const TOLERANCE: f32 = 1e-4;

/// `steps_<i>` of a fixture: the `[24, vocab]` logits that chose each greedy token of prompt i.
fn step_logits(dir: &Path) -> Vec<(usize, usize, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("expected_logits.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Vec::new();
    for i in 0..8 {
        if let Ok(t) = st.tensor(&format!("steps_{i}")) {
            let values = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            out.push((i, t.shape()[1], values));
        }
    }
    assert!(!out.is_empty(), "{} has no step logits", dir.display());
    out
}

fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// The logits a node samples each token of `prompt` from (greedy, `len` tokens).
fn sampled_logits(node: &mut DisaggregatedNode, prompt: &[u32], len: usize) -> Vec<Vec<f32>> {
    node.collect_logits(true);
    let request = GenerationRequest {
        prompt: prompt.to_vec(),
        max_tokens: len,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
    };
    driver::generate(node, std::slice::from_ref(&request), 0).unwrap();
    node.take_logits().into_iter().map(|(_, l)| l).collect()
}

#[test]
fn the_device_path_reproduces_every_fixture_through_the_cards() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let cases = expected(&dir);
        let requests = greedy_requests(&cases);
        for cards in [1, 3] {
            let (_cluster, mut node) = node(&dir, cards, AttentionDevice::CandleCpu);
            let got = driver::generate(&mut node, &requests, 0).unwrap();
            for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
                assert_eq!(&g.output_ids, want, "{name} prompt {i}, {cards} cards");
            }
        }
        let (_device_cluster, mut device) = node(&dir, 2, AttentionDevice::CandleCpu);
        let (_host_cluster, mut host) = node(&dir, 2, AttentionDevice::Cpu);
        for (i, vocab, steps) in step_logits(&dir) {
            let prompt = &cases[i].0;
            let rows = steps.len() / vocab;
            let on_device = sampled_logits(&mut device, prompt, rows);
            let on_host = sampled_logits(&mut host, prompt, rows);
            assert_eq!(on_device.len(), rows, "{name} prompt {i}");
            for (s, (d, h)) in on_device.iter().zip(&on_host).enumerate() {
                let want = &steps[s * vocab..(s + 1) * vocab];
                let diff = largest_difference(d, want);
                assert!(
                    diff <= TOLERANCE,
                    "{name} prompt {i} step {s}: the device path's logits differ from \
                     transformers' by {diff}"
                );
                let diff = largest_difference(d, h);
                assert!(
                    diff <= TOLERANCE,
                    "{name} prompt {i} step {s}: the device path and the CPU path differ by {diff}"
                );
            }
        }
    }
}

/// `afd generate` runs the device path (`--device candle-cpu`) and the device baseline
/// (`--reference --device candle-cpu`) from the command line, with transformers' tokens.
#[test]
fn afd_generate_takes_the_device_path_and_the_device_baseline() {
    let dir = common::fixture("gpt-oss-mxfp4");
    let (prompt, want) = expected(&dir).remove(2);
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    for extra in [&["--cards", "2"][..], &["--reference"][..]] {
        let stdout = common::afd_ok(|c| {
            c.arg("generate")
                .arg("--model")
                .arg(&dir)
                .args([
                    "--device",
                    "candle-cpu",
                    "--ignore-eos",
                    "--transport",
                    "inproc",
                ])
                .args(["--max-tokens", &want.len().to_string()])
                .args(["--prompt-ids", &ids.join(",")])
                .args(extra)
        });
        let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
        let got: Vec<u32> = v["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got, want, "{extra:?}");
    }
}

/// A build without the `cuda` feature says how to get one when asked for a GPU.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_refused_with_the_build_command() {
    let out = std::process::Command::new(common::AFD)
        .arg("generate")
        .arg("--model")
        .arg(common::fixture("mixtral"))
        .args(["--device", "cuda", "--prompt-ids", "1,2,3", "--cards", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--features cuda"), "{err}");
}
