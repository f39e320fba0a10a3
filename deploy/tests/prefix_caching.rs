//! Automatic prefix caching on the real model, through the router and a disaggregated node
//! with card programs over JetStream, on the host path and on the device path (candle's CPU
//! device): a request that continues another's prompt and output reuses its KV blocks and still
//! produces transformers' greedy tokens, on every fixture.

use std::path::Path;
use std::time::Instant;

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::AttentionDevice;
use model::sampling::SamplingParams;
use router::{GenerationRequest, Router, RouterConfig, SchedulerConfig, SequenceParams};
use step::{AttentionNode, Penalties, SampleRequest};

mod common;

use common::{expected, fixtures};

/// Tokens per KV block: small, so the fixtures' short prompts fill several.
const BLOCK_SIZE: usize = 4;
/// How many of transformers' output tokens the second round's prompts carry.
const CARRIED: usize = 12;

/// A router with prefix caching over one node of `cards` cards on `device`; keeps the cards
/// alive.
fn serve(dir: &Path, device: AttentionDevice) -> (EmbeddedCluster, Router) {
    let mut config = ClusterConfig::new(dir, 2);
    config.transport = TransportKind::Inproc;
    config.node.device = device;
    config.node.kv.memory_bytes = 8 << 20;
    config.node.kv.block_size = BLOCK_SIZE;
    config.replicate_experts = planner::ReplicateExperts::Never;
    let mut cluster = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
    let node = cluster.take_nodes().remove(0);
    assert!(node.shares_kv_blocks());
    let router_config = RouterConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            max_model_len: 256,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
        },
        max_waiting: 64,
    };
    let router = Router::start(router_config, vec![Box::new(node)]).unwrap();
    (cluster, router)
}

/// Greedy outputs of `prompts` (with their lengths), submitted together.
async fn run(router: &Router, prompts: &[(Vec<u32>, usize)]) -> Vec<Vec<u32>> {
    let mut streams: Vec<_> = prompts
        .iter()
        .map(|(prompt, max_tokens)| {
            router
                .submit(GenerationRequest {
                    prompt: prompt.clone(),
                    params: SequenceParams {
                        max_tokens: *max_tokens,
                        sample: SampleRequest {
                            params: SamplingParams::greedy(),
                            penalties: Penalties::default(),
                            logprobs: false,
                            top_logprobs: 0,
                            allowed: None,
                        },
                        stop_token_ids: Vec::new(),
                        constraint: None,
                        prompt_logprobs: None,
                    },
                    arrival: Instant::now(),
                })
                .unwrap()
        })
        .collect();
    let mut outputs = Vec::new();
    for stream in &mut streams {
        let mut tokens = Vec::new();
        while let Some(event) = stream.next().await {
            tokens.push(event.unwrap().token);
        }
        outputs.push(tokens);
    }
    outputs
}

fn check(dir: &Path, device: AttentionDevice) {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let cases = expected(dir);
    let (_cluster, router) = serve(dir, device);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // First round: the fixture's prompts, which fill (and register) the cache.
    let first: Vec<_> = cases
        .iter()
        .map(|(p, out)| (p.clone(), out.len()))
        .collect();
    let got = rt.block_on(run(&router, &first));
    for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
        assert_eq!(g, want, "{name} {device} prompt {i}, first round");
    }
    let before = router.stats().sum(|s| s.prefix_cache_hits_total);
    // Second round: each prompt with its first outputs, continued from the cached blocks.
    let second: Vec<_> = cases
        .iter()
        .map(|(p, out)| {
            let mut prompt = p.clone();
            prompt.extend(&out[..CARRIED]);
            (prompt, out.len() - CARRIED)
        })
        .collect();
    let got = rt.block_on(run(&router, &second));
    for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
        assert_eq!(
            g,
            &want[CARRIED..],
            "{name} {device} prompt {i}: the continuation from cached blocks"
        );
    }
    // Every full block of each second-round prompt but the one with its last token was
    // computed in the first round (the prompt and its first outputs), so all are hits.
    let hits = router.stats().sum(|s| s.prefix_cache_hits_total) - before;
    let expected_hits: usize = second
        .iter()
        .map(|(p, _)| (p.len() - 1) / BLOCK_SIZE * BLOCK_SIZE)
        .sum();
    assert_eq!(hits, expected_hits as u64, "{name} {device}");
}

#[test]
fn a_continued_prompt_reuses_cached_blocks_and_keeps_transformers_tokens_on_the_host_path() {
    for dir in fixtures() {
        check(&dir, AttentionDevice::Cpu);
    }
}

#[test]
fn a_continued_prompt_reuses_cached_blocks_and_keeps_transformers_tokens_on_the_device_path() {
    for dir in fixtures() {
        check(&dir, AttentionDevice::CandleCpu);
    }
}
