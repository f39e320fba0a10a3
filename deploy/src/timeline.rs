//! One Chrome trace of a run: the attention node's per-layer spans and, beside them, each
//! embedded card's messages (waiting for a CPU turn, then computing, with the worker's CPU
//! time), on one clock.

use std::time::Instant;

use corsair_ffn::service::CardSpan;
use gpu_attention::node::{Span, chrome_trace};
use proto::data::LM_HEAD_LAYER;
use serde_json::{Value, json};

/// Chrome trace-event JSON: the node's `spans` (process 1, a track per micro-batch) and the
/// cards' (process 2, a track per card), both in microseconds since `origin` (the node's
/// [`gpu_attention::node::DisaggregatedNode::trace_origin`]). A card span becomes two events:
/// `wait` from landing to its turn, `compute` from there to its reply (its args carry the
/// worker's CPU time, `cpu_ms`, and its context switches, `preempted` and `blocked`).
pub fn run_trace(spans: &[Span], origin: Instant, cards: &[CardSpan]) -> Value {
    let mut trace = chrome_trace(spans);
    let us = |t: Instant| t.saturating_duration_since(origin).as_secs_f64() * 1e6;
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "attention node"}}),
        json!({"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "cards"}}),
    ];
    let mut named = std::collections::BTreeSet::new();
    for c in cards {
        if named.insert(c.card) {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": 2, "tid": c.card,
                "args": {"name": format!("card {}", c.card)},
            }));
        }
        let what = if c.layer == LM_HEAD_LAYER {
            "lm-head".to_string()
        } else {
            format!("L{}", c.layer)
        };
        let args = json!({"step": c.step, "micro_batch": c.micro_batch});
        // The compute span also says how much of it the worker spent on a CPU.
        let mut compute_args = args.clone();
        compute_args["cpu_ms"] = json!(c.thread.cpu_us as f64 / 1e3);
        compute_args["preempted"] = json!(c.thread.involuntary_switches);
        compute_args["blocked"] = json!(c.thread.voluntary_switches);
        for (name, from, to, args) in [
            ("wait", c.landed, c.started, &args),
            ("compute", c.started, c.ended, &compute_args),
        ] {
            events.push(json!({
                "name": format!("{name} {what}"), "cat": name, "ph": "X",
                "ts": us(from), "dur": us(to) - us(from), "pid": 2, "tid": c.card,
                "args": args,
            }));
        }
    }
    if let Some(list) = trace["traceEvents"].as_array_mut() {
        list.extend(events);
    }
    trace
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn card_spans_sit_on_the_node_clock_as_wait_and_compute() {
        let origin = Instant::now();
        let at = |ms: u64| origin + Duration::from_millis(ms);
        let node = [Span {
            name: "attention",
            layer: 3,
            micro_batch: 0,
            start_us: 0.0,
            duration_us: 1000.0,
        }];
        let card = CardSpan {
            card: 5,
            step: 9,
            layer: 3,
            micro_batch: 1,
            landed: at(2),
            started: at(3),
            ended: at(7),
            thread: corsair_ffn::service::ThreadUsage {
                cpu_us: 2500,
                voluntary_switches: 1,
                involuntary_switches: 3,
            },
        };
        let lm = CardSpan {
            layer: LM_HEAD_LAYER,
            ..card
        };
        let trace = run_trace(&node, origin, &[card, lm]);
        let events = trace["traceEvents"].as_array().expect("an event list");
        let find = |name: &str| {
            events
                .iter()
                .find(|e| e["name"] == name)
                .unwrap_or_else(|| panic!("no {name} event in {events:?}"))
        };
        assert_eq!(find("attention L3")["pid"], 1);
        let wait = find("wait L3");
        assert_eq!(
            (wait["pid"].clone(), wait["tid"].clone()),
            (json!(2), json!(5))
        );
        assert_eq!(wait["ts"].as_f64(), Some(2000.0));
        assert_eq!(wait["dur"].as_f64(), Some(1000.0));
        let compute = find("compute L3");
        assert_eq!(compute["ts"].as_f64(), Some(3000.0));
        assert_eq!(compute["dur"].as_f64(), Some(4000.0));
        assert_eq!(compute["args"]["step"], 9);
        assert_eq!(compute["args"]["cpu_ms"].as_f64(), Some(2.5));
        assert_eq!(compute["args"]["preempted"], 3);
        assert_eq!(compute["args"]["blocked"], 1);
        assert!(wait["args"].get("cpu_ms").is_none());
        assert_eq!(find("compute lm-head")["dur"].as_f64(), Some(4000.0));
        // One name per card track, however many spans it has.
        let names = events.iter().filter(|e| e["name"] == "thread_name").count();
        assert_eq!(names, 1);
    }
}
