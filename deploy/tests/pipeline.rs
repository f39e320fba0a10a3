//! The disaggregated pipeline end to end in one process: real card programs (corsair-ffn) over
//! JetStream (QUIC on loopback and in-process) against the transformers fixtures.

use std::path::Path;

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::driver;
use model::generate::GenerationRequest;
use model::sampling::SamplingParams;
use planner::ReplicateExperts;

mod common;

use common::{expected, fixtures, greedy_requests};

/// One copy of every expert unless a test asks for more: left at `auto`, the placement would
/// depend on the memory of the host the tests run on (see `planner::replication`).
fn config(dir: &Path, cards: usize, transport: TransportKind) -> ClusterConfig {
    let mut config = ClusterConfig::new(dir, cards);
    config.transport = transport;
    config.node.kv.memory_bytes = 8 << 20;
    config.replicate_experts = ReplicateExperts::Never;
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
fn greedy_tokens_match_transformers_for_every_fixture_card_count_transport_and_placement() {
    for dir in fixtures() {
        let cases = expected(&dir);
        let requests = greedy_requests(&cases);
        // Both placements in process (one copy of each expert, and a copy of every expert on
        // a second card); QUIC with one copy.
        let runs = [
            (TransportKind::Inproc, ReplicateExperts::Never),
            (TransportKind::Inproc, ReplicateExperts::Always),
            (TransportKind::Quic, ReplicateExperts::Never),
        ];
        for (transport, placement) in runs {
            let first = if placement == ReplicateExperts::Always {
                2
            } else {
                1
            };
            for cards in first..=4 {
                let mut config = config(&dir, cards, transport);
                config.replicate_experts = placement;
                let mut c = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
                let mut node = c.take_nodes().remove(0);
                let got = driver::generate(&mut node, &requests, 0).unwrap();
                for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
                    assert_eq!(
                        &g.output_ids,
                        want,
                        "{} prompt {i}, {cards} cards, {transport:?}, replicate {placement:?}",
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
    generate_with_stats(dir, cards, prompts, max_tokens, sampling).0
}

/// [`generate`], and the node's counters (steps, tokens, rows sampled from full logits because
/// the cards' proposals could not decide them).
fn generate_with_stats(
    dir: &Path,
    cards: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    sampling: SamplingParams,
) -> (Vec<Vec<u32>>, gpu_attention::node::NodeStats) {
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
    (tokens, node.stats())
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
    let (batched, stats) = generate_with_stats(&dir, 3, &prompts, 10, SamplingParams::greedy());
    // The eight really went together: one prompt step and nine decode steps of all eight.
    assert!(stats.steps <= 11, "{stats:?}");
    assert!(
        stats.tokens >= 8 * stats.steps.saturating_sub(2),
        "{stats:?}"
    );
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
        config.replicate_experts = ReplicateExperts::Always;
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
        let out = driver::generate(&mut node, &requests, 0).unwrap();
        // Tokens each card computed of each (layer, expert).
        let per_card: Vec<Vec<u64>> = c
            .card_stats()
            .into_iter()
            .map(|s| s.expert_tokens)
            .collect();
        (out, per_card)
    };
    let prompts = eight_prompts();
    let (batched, per_card) = run(&prompts);
    // Which card computes which expert did depend on the batch: some expert of some layer was
    // computed by both cards over the run's steps.
    let both = (0..per_card[0].len())
        .filter(|&i| per_card[0][i] > 0 && per_card[1][i] > 0)
        .count();
    assert!(both > 0, "every expert stayed on one card: {per_card:?}");
    for i in [0, 5] {
        let alone = run(std::slice::from_ref(&prompts[i])).0.remove(0);
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
                let (tokens, stats) = generate_with_stats(&dir, cards, &prompts, 8, sampling);
                assert_eq!(tokens, one, "{name}: {cards} cards");
                // The cards send what filtered sampling needs (their scaled log-sum-exp), and
                // their candidates cover these fixtures' nuclei: every one of the 64 rows is
                // decided from the proposals, none from the full logits.
                assert_eq!(
                    stats.full_logits_rows, 0,
                    "{name}: {cards} cards, rows sampled from full logits"
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
    let mut config = config(&dir, 2, TransportKind::Quic);
    // Two executor threads a card: the pool's threads set their policy too.
    config.card_threads = 2;
    let mut c = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
    let mut node = c.take_nodes().remove(0);
    let request = short_greedy_request(2);
    // Every worker has computed a message by now, so each has set up its thread.
    driver::generate(&mut node, std::slice::from_ref(&request), 0).unwrap();
    // Other tests' clusters may run in this process too: their threads count alike, one that
    // ended meanwhile is skipped, and one just started may be named before it has set its
    // policy, so a thread under another policy is looked at again until it settles.
    let card_threads = || -> Vec<(String, i32)> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| {
                let task = task.ok()?;
                let name = std::fs::read_to_string(task.path().join("comm")).ok()?;
                let name = name.trim();
                let worker = name.starts_with("card-") && name.ends_with("-worker");
                if !(worker || name.starts_with("corsair-exec-")) {
                    return None;
                }
                let tid: i32 = task.file_name().to_str()?.parse().ok()?;
                // SAFETY: reads the policy of a thread of this process; -1 if it has ended.
                let policy = unsafe { libc::sched_getscheduler(tid) };
                (policy >= 0).then(|| (name.to_string(), policy))
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let policies = loop {
        let policies = card_threads();
        let settled = policies.iter().all(|(_, p)| *p == libc::SCHED_BATCH);
        if settled || std::time::Instant::now() > deadline {
            break policies;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let count = |prefix: &str| {
        policies
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .count()
    };
    assert!(
        count("card-") >= 2,
        "this cluster's two workers: {policies:?}"
    );
    assert!(
        count("corsair-exec-") >= 4,
        "this cluster's two executor pools of two: {policies:?}"
    );
    for (name, policy) in &policies {
        assert_eq!(*policy, libc::SCHED_BATCH, "{name} is not batch work");
    }
}
