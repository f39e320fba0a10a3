//! Prompt logprobs on the real model, against transformers: every prompt token's logprob (and
//! its best alternatives) equals the log-softmax of the logits transformers computed at the
//! position before it (`prompt_<i>` in each fixture), within 1e-4, on every path a deployment
//! runs: the disaggregated node with the LM head sharded over its cards (merged from the cards'
//! proposals, and through the full-logits gather), on the host path and the device path
//! (candle's CPU device), and the whole model on the node (host and device). Prompts are
//! scored in two chunks, so positions after the first chunk come from the cache.

use std::path::Path;

use gpu_attention::device::DeviceMonolithicNode;
use gpu_attention::kv_cache::KvCacheConfig;
use gpu_attention::{AttentionDevice, MonolithicNode};
use model::sampling::{SamplingParams, log_softmax};
use safetensors::SafeTensors;
use step::{
    AttentionNode, Penalties, PromptScoring, SampleRequest, ScoredToken, StepBatch, StepEntry,
};

mod common;

use common::{embedded_node as cluster, expected, fixtures};

const TOLERANCE: f32 = 1e-4;
/// Alternatives asked per position.
const TOP: usize = 3;

/// transformers' log-softmax at every position of prompt `i` (`[T][vocab]`).
fn reference(dir: &Path, i: usize) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(dir.join("expected_logits.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(&format!("prompt_{i}")).unwrap();
    let vocab = t.shape()[1];
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    values.chunks_exact(vocab).map(log_softmax).collect()
}

/// Scores `prompt` on `node` as sequence `seq` in two chunks (the second samples), returning
/// the scores in prompt order.
fn score(node: &mut dyn AttentionNode, seq: u64, prompt: &[u32]) -> Vec<ScoredToken> {
    let capacity = node.kv_capacity();
    let table: Vec<u32> = (0..prompt.len().div_ceil(capacity.block_size) as u32).collect();
    let split = prompt.len().div_ceil(2);
    let mut scores = Vec::new();
    for (start, end) in [(0, split), (split, prompt.len())] {
        let last = end == prompt.len();
        let entry = StepEntry {
            seq,
            tokens: prompt[start..end].to_vec(),
            start,
            prompt_len: prompt.len(),
            block_table: table.clone(),
            sample: last.then(|| SampleRequest {
                params: SamplingParams::greedy(),
                penalties: Penalties::default(),
                logprobs: true,
                top_logprobs: 0,
                allowed: None,
            }),
            cached_prefix: Vec::new(),
            prompt_logprobs: PromptScoring::for_chunk(prompt, start, end - start, TOP),
        };
        let out = node
            .step(&StepBatch {
                entries: vec![entry],
            })
            .unwrap();
        assert_eq!(out.sampled.len(), usize::from(last));
        for p in out.prompt_logprobs {
            assert_eq!(p.seq, seq);
            scores.extend(p.tokens);
        }
    }
    node.free(&[seq]).unwrap();
    scores
}

/// Checks `scores` of prompt `i` against transformers.
fn check(path: &str, dir: &Path, i: usize, prompt: &[u32], scores: &[ScoredToken]) {
    let name = dir.file_name().unwrap().to_string_lossy();
    let want = reference(dir, i);
    assert_eq!(
        scores.len(),
        prompt.len() - 1,
        "{name} prompt {i} on {path}"
    );
    for (p, s) in scores.iter().enumerate() {
        let row = &want[p];
        let target = prompt[p + 1];
        assert_eq!(s.token, target);
        let at = format!("{name} prompt {i} position {} on {path}", p + 1);
        assert!(
            (s.logprob - row[target as usize]).abs() < TOLERANCE,
            "{at}: {} vs transformers' {}",
            s.logprob,
            row[target as usize]
        );
        let mut best: Vec<f32> = row.clone();
        best.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(s.top_logprobs.len(), TOP, "{at}");
        for (k, &(token, logprob)) in s.top_logprobs.iter().enumerate() {
            assert!(
                (logprob - best[k]).abs() < TOLERANCE,
                "{at}: alternative {k}"
            );
            assert!(
                (row[token as usize] - logprob).abs() < TOLERANCE,
                "{at}: alternative {k} is token {token}"
            );
        }
    }
}

#[test]
fn prompt_logprobs_match_transformers_on_every_path_and_fixture() {
    for dir in fixtures() {
        let cases = expected(&dir);
        let weights = model::ModelWeights::load(&dir).unwrap();
        let (_host_cards, mut host) = cluster(&dir, 2, AttentionDevice::Cpu);
        let (_device_cards, mut device) = cluster(&dir, 3, AttentionDevice::CandleCpu);
        let (_gather_cards, mut gathered) = cluster(&dir, 2, AttentionDevice::Cpu);
        // Every row through the full-logits gather, as when an LM-head card is down.
        gathered.collect_logits(true);
        let kv = KvCacheConfig {
            memory_bytes: 8 << 20,
            ..KvCacheConfig::default()
        };
        let mut device_whole =
            DeviceMonolithicNode::new(&weights, &kv, AttentionDevice::CandleCpu).unwrap();
        let reference_model = model::forward::ReferenceModel::new(weights.clone()).unwrap();
        let mut whole = MonolithicNode::new(reference_model, device_whole.kv_capacity());
        for (i, (prompt, _)) in cases.iter().enumerate() {
            let seq = i as u64 + 1;
            check(
                "the host path, 2 cards",
                &dir,
                i,
                prompt,
                &score(&mut host, seq, prompt),
            );
            check(
                "the device path, 3 cards",
                &dir,
                i,
                prompt,
                &score(&mut device, seq, prompt),
            );
            let before = gathered.stats().full_logits_rows;
            let scores = score(&mut gathered, seq, prompt);
            check("the full-logits gather", &dir, i, prompt, &scores);
            assert_eq!(
                gathered.stats().full_logits_rows - before,
                prompt.len() as u64,
                "every scored row and the sample gathered"
            );
            check(
                "the node alone",
                &dir,
                i,
                prompt,
                &score(&mut whole, seq, prompt),
            );
            check(
                "the device alone",
                &dir,
                i,
                prompt,
                &score(&mut device_whole, seq, prompt),
            );
        }
        assert_eq!(
            host.stats().full_logits_rows,
            0,
            "the merge decided every row"
        );
    }
}
