//! The emulation on the `tiny` GPT-OSS shape: queueing, determinism, a card failure, the trace.

use std::sync::Arc;
use std::time::Duration;

use corsair_ffn::compiler::StoredFormats;
use loadtest::{BenchmarkConfig, PromptConfig, PromptSource};
use model::ModelConfig;
use planner::{AttentionTarget, CardsTarget, PlannedWorkload, Profiles, ReplicateExperts, Target};
use router::{RouterConfig, SchedulerConfig};
use step::{KvCapacity, MicroBatches};

use super::*;

fn shape() -> (ModelConfig, StoredFormats) {
    planner::named_shape(model::Family::GptOss, "tiny").unwrap()
}

fn target(cards: usize, replicate: bool, micro_batches: MicroBatches) -> Target {
    Target {
        source: "test".into(),
        model_name: "tiny".into(),
        attention: AttentionTarget {
            nodes: 1,
            max_num_seqs: 16,
            max_model_len: 512,
            kv_cache_memory_mib: None,
            max_num_batched_tokens: 256,
            wire_bytes: 2,
        },
        cards: CardsTarget {
            count: cards,
            format: corsair_ffn::FormatChoice::AsStored,
            allow_spill: false,
            replicas: Vec::new(),
            replicate_experts: if replicate {
                ReplicateExperts::Always
            } else {
                ReplicateExperts::Never
            },
            groups: 1,
        },
        micro_batches,
        workload: PlannedWorkload {
            batch: 1,
            input_len: 64,
            output_len: 0,
        },
    }
}

fn emulation(cards: usize, replicate: bool, fault: Option<CardFault>) -> Emulation {
    let (config, stored) = shape();
    let profiles = Profiles {
        device: planner::DeviceProfile::builtin("h100").unwrap().unwrap(),
        card: corsair_ffn::HardwareProfile::default(),
        network: planner::NetworkProfile::builtin("jetstream")
            .unwrap()
            .unwrap(),
    };
    let t = target(cards, replicate, MicroBatches::Auto);
    let model = StepModel::new(&t, config.clone(), &stored, profiles).unwrap();
    Emulation {
        model: Arc::new(model),
        deployment: "test".into(),
        model_name: "tiny".into(),
        router: RouterConfig {
            scheduler: SchedulerConfig {
                max_num_seqs: 16,
                max_num_batched_tokens: 256,
                max_model_len: 512,
                enable_chunked_prefill: true,
                enable_prefix_caching: true,
            },
            max_waiting: 1024,
        },
        nodes: 1,
        kv: KvCapacity {
            block_size: 16,
            num_blocks: 16 * 512 / 16,
        },
        routing: RoutingSource::Uniform,
        eos_token_ids: config.eos_token_ids.clone(),
        tokenize: None,
        detokenize: None,
        fault,
    }
}

fn bench(prompts: usize, rate: f64, concurrency: Option<usize>) -> BenchmarkConfig {
    BenchmarkConfig {
        num_prompts: prompts,
        prompts: PromptConfig {
            source: PromptSource::TokenIds,
            input_len: 64,
            prefix_len: 0,
            output_len: 16,
            range_ratio: 0.0,
            vocab_size: 100,
        },
        ignore_eos: true,
        request_rate: rate,
        max_concurrency: concurrency,
        num_warmups: 0,
        ..BenchmarkConfig::default()
    }
}

fn run(e: &Emulation, b: &BenchmarkConfig) -> EmulatedRun {
    let nodes = e.synthetic_nodes(b.seed).unwrap();
    e.run(b, nodes, Some(8), |_| {}).unwrap()
}

/// One request alone: every token after the first is one decode step, so the run's TPOT is
/// the step model's decode step at that context, and TTFT its prefill step.
#[test]
fn one_request_alone_takes_the_modeled_steps() {
    let e = emulation(2, false, None);
    let r = run(&e, &bench(1, f64::INFINITY, Some(1)));
    assert_eq!((r.result.completed, r.result.failed), (1, 0));
    assert_eq!(r.result.total_output_tokens, 16);
    let steps = &r.sim.steps;
    assert_eq!(steps.len(), 16, "one prefill step and 15 decode steps");
    let prefill = steps[0].modeled.detail.time.seconds;
    assert!(
        (r.result.ttfts[0] - prefill).abs() < 1e-8,
        "{} vs {prefill}",
        r.result.ttfts[0]
    );
    let decode: f64 = steps[1..]
        .iter()
        .map(|s| s.modeled.detail.time.seconds)
        .sum::<f64>()
        / 15.0;
    let tpot = r.result.latency.tpot.mean_ms / 1e3;
    // Each step is rounded to the nanosecond.
    assert!((tpot - decode).abs() / decode < 1e-5, "{tpot} vs {decode}");
    assert!(decode > 0.0 && prefill > decode);
    // The result says it is modeled.
    let base = r.result.time_base.as_ref().unwrap();
    assert_eq!(base.clock, "modeled");
    let emulation = r.result.emulation.as_ref().unwrap();
    assert_eq!(emulation["routing"], "uniform");
    assert_eq!(emulation["steps"]["decode_only"]["steps"], 15);
}

/// Past saturation requests queue: at a rate far above what the deployment serves, TTFT grows
/// along the run, while at a light rate it stays at the prefill.
#[test]
fn queueing_shows_past_saturation() {
    let e = emulation(2, false, None);
    let light = run(&e, &bench(16, 1.0, None));
    let heavy = run(&e, &bench(64, 1e7, Some(64)));
    assert_eq!(light.result.failed + heavy.result.failed, 0);
    let first = heavy.result.ttfts[0];
    let last = *heavy.result.ttfts.last().unwrap();
    assert!(last > 2.0 * first, "TTFT {first} .. {last}");
    let spread = |r: &EmulatedRun| {
        let t = &r.result.ttfts;
        t.iter().cloned().fold(0.0, f64::max) / t.iter().cloned().fold(f64::MAX, f64::min)
    };
    assert!(spread(&light) < 1.5, "light load: {:?}", light.result.ttfts);
    assert!(heavy.result.output_throughput > light.result.output_throughput);
}

/// The same seed gives the same figures, a different seed different arrivals.
#[test]
fn the_same_seed_gives_the_same_figures() {
    let e = emulation(2, false, None);
    let b = bench(24, 200.0, Some(8));
    let strip = |r: EmulatedRun| {
        let mut v = serde_json::to_value(&r.result).unwrap();
        v.as_object_mut().unwrap().remove("date");
        serde_json::to_string(&v).unwrap()
    };
    let (a, again) = (strip(run(&e, &b)), strip(run(&e, &b)));
    assert_eq!(a, again);
    let other = strip(run(
        &e,
        &BenchmarkConfig {
            seed: 9,
            ..b.clone()
        },
    ));
    assert_ne!(a, other);
}

/// A card that dies with nothing covering it: the requests in flight fail (503), new ones are
/// refused while it is down, and once it is back (its shard reloaded) requests succeed again.
/// With every expert replicated, the same failure loses nothing.
#[test]
fn a_card_failure_follows_the_reliability_path() {
    let b = bench(40, 50.0, None);
    let at = Duration::from_millis(150);
    let fault = CardFault {
        card: 1,
        at,
        down_for: Some(Duration::from_millis(300)),
    };
    let e = emulation(2, false, Some(fault.clone()));
    let r = run(&e, &b);
    let f = &r.result.emulation.as_ref().unwrap()["fault"];
    assert_eq!(f["covered_by_replicas"], false);
    let detected = f["detected_at_s"].as_f64().unwrap();
    let back = f["back_at_s"].as_f64().unwrap();
    assert!(
        detected >= at.as_secs_f64() && back > detected + 0.3 - 1e-9,
        "{f}"
    );
    assert!(
        r.result.failed > 0 && r.result.completed > 0,
        "{} failed",
        r.result.failed
    );
    for (i, error) in r.result.errors.iter().enumerate() {
        let start = r.result.start_times[i];
        if error.is_empty() {
            // Served: it started after the card was back, or finished before it died.
            let end = start + r.result.latencies[i];
            assert!(
                start >= back - 1e-9 || end <= detected + 0.03,
                "request {i}: {start}..{end}"
            );
        } else {
            assert!(error.contains("503") || error.contains("card 1"), "{error}");
        }
    }
    let covered = emulation(2, true, Some(fault));
    let r = run(&covered, &b);
    assert_eq!(r.result.failed, 0, "{:?}", r.result.failure_reasons);
    assert_eq!(
        r.result.emulation.as_ref().unwrap()["fault"]["covered_by_replicas"],
        true
    );
}

/// The trace has a track per card and slices on them, none negative.
#[test]
fn the_trace_draws_devices_and_cards() {
    let e = emulation(2, false, None);
    let r = run(&e, &bench(8, f64::INFINITY, Some(8)));
    let steps = trace::pick_steps(&r.sim.steps, 2);
    assert_eq!(steps.len(), 3, "a prompt step and two decode steps");
    let t = trace::chrome_trace(&steps, 2);
    let events = t["traceEvents"].as_array().unwrap();
    let named = |name: &str| events.iter().any(|e| e["args"]["name"] == name);
    assert!(named("attention device") && named("card 0") && named("card 1"));
    let slices: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(
        slices.iter().any(|e| e["tid"] == 11),
        "card 1 computes something"
    );
    assert!(slices.iter().all(|e| e["dur"].as_f64().unwrap() >= 0.0));
    // The routing record counts every step.
    let counts = r.sim.routing.as_ref().unwrap();
    let steps_counted: u64 = counts.windows.iter().map(|w| w.steps).sum();
    assert_eq!(steps_counted as usize, r.sim.steps.len());
}
