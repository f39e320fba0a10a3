//! The disaggregated pipeline end to end in one process: real card programs (corsair-ffn) over
//! JetStream (QUIC on loopback and in-process) against the transformers fixtures.

use std::path::Path;

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::driver;
use model::generate::GenerationRequest;
use model::sampling::SamplingParams;

mod common;

use common::{expected, fixtures, greedy_requests};

fn config(dir: &Path, cards: usize, transport: TransportKind) -> ClusterConfig {
    let mut config = ClusterConfig::new(dir, cards);
    config.transport = transport;
    config.node.kv.memory_bytes = 8 << 20;
    config
}

fn cluster(dir: &Path, cards: usize, transport: TransportKind) -> EmbeddedCluster {
    EmbeddedCluster::start(&config(dir, cards, transport), &mut |_| {}).unwrap()
}

/// The fixture checkpoint whose directory is named `name`.
fn fixture(name: &str) -> std::path::PathBuf {
    fixtures().into_iter().find(|d| d.ends_with(name)).unwrap()
}

#[test]
fn greedy_tokens_match_transformers_for_every_fixture_card_count_and_transport() {
    for dir in fixtures() {
        let cases = expected(&dir);
        let requests = greedy_requests(&cases);
        for transport in [TransportKind::Inproc, TransportKind::Quic] {
            for cards in 1..=4 {
                let mut c = cluster(&dir, cards, transport);
                let mut node = c.take_nodes().remove(0);
                let got = driver::generate(&mut node, &requests, 0).unwrap();
                for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
                    assert_eq!(
                        &g.output_ids,
                        want,
                        "{} prompt {i}, {cards} cards, {transport:?}",
                        dir.display()
                    );
                }
            }
        }
    }
}

fn generate(
    dir: &Path,
    cards: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    sampling: SamplingParams,
) -> Vec<Vec<u32>> {
    generate_counting_fallbacks(dir, cards, prompts, max_tokens, sampling).0
}

/// [`generate`], and how many rows the node had to sample from full logits because the cards'
/// proposals could not decide them.
fn generate_counting_fallbacks(
    dir: &Path,
    cards: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    sampling: SamplingParams,
) -> (Vec<Vec<u32>>, u64) {
    let mut c = cluster(dir, cards, TransportKind::Inproc);
    let mut node = c.take_nodes().remove(0);
    let requests: Vec<GenerationRequest> = prompts
        .iter()
        .map(|p| GenerationRequest {
            prompt: p.clone(),
            max_tokens,
            sampling,
            stop_token_ids: vec![],
        })
        .collect();
    let tokens = driver::generate(&mut node, &requests, 0)
        .unwrap()
        .into_iter()
        .map(|g| g.output_ids)
        .collect();
    (tokens, node.stats().full_logits_rows)
}

fn eight_prompts() -> Vec<Vec<u32>> {
    (0..8u32)
        .map(|i| (0..(1 + i * 5)).map(|j| (j * 37 + i * 11) % 250).collect())
        .collect()
}

#[test]
fn a_sequence_gets_the_same_tokens_alone_and_in_a_batch_of_eight() {
    let dir = fixture("gpt-oss-bf16");
    let prompts = eight_prompts();
    let batched = generate(&dir, 3, &prompts, 10, SamplingParams::greedy());
    for i in [0, 3, 7] {
        let alone = generate(
            &dir,
            3,
            std::slice::from_ref(&prompts[i]),
            10,
            SamplingParams::greedy(),
        );
        assert_eq!(alone[0], batched[i], "sequence {i}");
    }
}

#[test]
fn with_every_expert_copied_a_top2_token_rounds_the_same_alone_and_in_a_batch() {
    // Mixtral's fixture routes each token to 2 of 4 experts; on 2 cards that both hold every
    // expert, which card computes which expert depends on the batch. The two weighted outputs
    // are added once, from zero, in either order: the logprobs must be the same bits.
    let dir = fixture("mixtral");
    let run = |prompts: &[Vec<u32>]| {
        let mut config = config(&dir, 2, TransportKind::Inproc);
        config.replicate_experts = planner::ReplicateExperts::Always;
        let mut c = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
        let mut node = c.take_nodes().remove(0);
        let requests: Vec<GenerationRequest> = prompts
            .iter()
            .map(|p| GenerationRequest {
                prompt: p.clone(),
                max_tokens: 8,
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
            })
            .collect();
        driver::generate(&mut node, &requests, 0).unwrap()
    };
    let prompts = eight_prompts();
    let batched = run(&prompts);
    for i in [0, 5] {
        let alone = run(std::slice::from_ref(&prompts[i])).remove(0);
        assert_eq!(alone.output_ids, batched[i].output_ids, "sequence {i}");
        let bits = |g: &model::generate::Generation| -> Vec<u32> {
            g.logprobs.iter().map(|l| l.to_bits()).collect()
        };
        assert_eq!(bits(&alone), bits(&batched[i]), "sequence {i}");
    }
}

#[test]
fn seeded_sampling_gives_the_same_tokens_for_every_card_count() {
    for name in ["gpt-oss-mxfp4", "qwen3-moe"] {
        let dir = fixture(name);
        let prompts = eight_prompts();
        let top_k = SamplingParams {
            temperature: 0.9,
            seed: 42,
            top_k: 20,
            ..Default::default()
        };
        // Top-p and min-p, decided from the cards' candidates when they prove it.
        let nucleus = SamplingParams {
            temperature: 0.7,
            seed: 7,
            top_p: 0.9,
            min_p: 0.05,
            ..Default::default()
        };
        for sampling in [top_k, nucleus] {
            let one = generate(&dir, 1, &prompts, 8, sampling);
            for cards in [2, 3, 4] {
                let (tokens, fallbacks) =
                    generate_counting_fallbacks(&dir, cards, &prompts, 8, sampling);
                assert_eq!(tokens, one, "{name}: {cards} cards");
                // The cards send what filtered sampling needs (their scaled log-sum-exp), so
                // most of the 64 rows are decided from their proposals.
                assert!(
                    fallbacks < 32,
                    "{name}: {cards} cards, {fallbacks} rows from full logits"
                );
            }
            // The same as the reference's sampler.
            let mut m =
                model::ReferenceModel::new(model::ModelWeights::load(&dir).unwrap()).unwrap();
            let requests: Vec<GenerationRequest> = prompts
                .iter()
                .map(|p| GenerationRequest {
                    prompt: p.clone(),
                    max_tokens: 8,
                    sampling,
                    stop_token_ids: vec![],
                })
                .collect();
            let reference: Vec<Vec<u32>> = model::generate::generate(&mut m, &requests, 0)
                .unwrap()
                .into_iter()
                .map(|g| g.output_ids)
                .collect();
            assert_eq!(one, reference, "{name} {sampling:?}");
        }
    }
}

/// A three-token prompt decoded greedily for `max_tokens` tokens.
fn short_greedy_request(max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt: vec![3, 14, 15],
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
    }
}

/// With tracing on, every message a card computed is on the run's timeline, between its
/// landing and its reply, beside the node's spans.
#[test]
fn a_traced_run_lays_every_card_message_beside_the_node_spans() {
    let dir = fixture("gpt-oss-bf16");
    let mut config = config(&dir, 2, TransportKind::Inproc);
    config.node.trace = true;
    let mut c = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
    let mut node = c.take_nodes().remove(0);
    let request = short_greedy_request(4);
    driver::generate(&mut node, std::slice::from_ref(&request), 0).unwrap();
    let spans = c.take_card_spans();
    let messages: u64 = c.card_stats().iter().map(|s| s.messages).sum();
    assert_eq!(spans.len() as u64, messages, "a span per message computed");
    let layers = model::ModelConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .num_layers();
    for s in &spans {
        assert!(s.card < 2, "{s:?}");
        assert!(s.landed <= s.started && s.started <= s.ended, "{s:?}");
        assert!(
            usize::from(s.layer) < layers || s.layer == proto::data::LM_HEAD_LAYER,
            "{s:?}"
        );
    }
    // Four steps' LM heads on both cards, and layer messages besides.
    let lm = spans
        .iter()
        .filter(|s| s.layer == proto::data::LM_HEAD_LAYER)
        .count();
    assert_eq!(lm, 2 * 4);
    assert!(spans.len() > lm);
    let trace = deploy::timeline::run_trace(&node.take_trace(), node.trace_origin(), &spans);
    let events = trace["traceEvents"].as_array().unwrap();
    let on = |pid: u64| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid)
            .count()
    };
    assert!(on(1) > 0, "no node spans");
    assert_eq!(
        on(2),
        2 * spans.len(),
        "a wait and a compute event per card message"
    );
    // Taken once: the log starts empty again.
    assert!(c.take_card_spans().is_empty());
}

/// The card workers run as batch work (`corsair_ffn::host_cpus::run_as_batch_work`): a message
/// landing wakes its card without preempting the node's stepping thread, which still has the
/// layer's other messages to send.
#[cfg(target_os = "linux")]
#[test]
fn the_card_workers_run_as_batch_work() {
    let dir = fixture("gpt-oss-bf16");
    let mut c = cluster(&dir, 2, TransportKind::Quic);
    let mut node = c.take_nodes().remove(0);
    let request = short_greedy_request(2);
    // Every worker has computed a message by now, so each has set up its thread.
    driver::generate(&mut node, std::slice::from_ref(&request), 0).unwrap();
    // Other tests' clusters may run in this process too: their workers count alike, and
    // one that ended meanwhile is skipped.
    let policies: Vec<(String, i32)> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| {
            let task = task.ok()?;
            let name = std::fs::read_to_string(task.path().join("comm")).ok()?;
            let name = name.trim();
            if !(name.starts_with("card-") && name.ends_with("-worker")) {
                return None;
            }
            let tid: i32 = task.file_name().to_str()?.parse().ok()?;
            // SAFETY: reads the policy of a thread of this process; -1 if it has ended.
            let policy = unsafe { libc::sched_getscheduler(tid) };
            (policy >= 0).then(|| (name.to_string(), policy))
        })
        .collect();
    assert!(
        policies.len() >= 2,
        "this cluster's two workers: {policies:?}"
    );
    for (name, policy) in &policies {
        assert_eq!(*policy, libc::SCHED_BATCH, "{name} is not batch work");
    }
}
