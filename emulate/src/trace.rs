//! A few modeled steps as a Chrome/Perfetto trace (the JSON trace-event format that
//! `chrome://tracing` and ui.perfetto.dev open): the attention device, the network each way and
//! each card as tracks, every micro-batch's part of every layer as a slice.
//!
//! The timeline is laid out from the step model's own figures: layer `l + 1` starts one period
//! after layer `l` did; within a layer the device runs the micro-batches' kernels one after the
//! other, each micro-batch's rows go out when its kernels end, every card computes its rows on
//! arrival, and the sums come back when the slowest card is done. So the gaps on the device's
//! track are the bubble the model charges, and the slices on the cards show who set the pace.

use serde_json::{Value, json};

use crate::sim::StepRecord;

const DEVICE: u64 = 1;
const OUT: u64 = 2;
const BACK: u64 = 3;
const FIRST_CARD: u64 = 10;

fn slice(name: String, tid: u64, start_s: f64, dur_s: f64, args: Value) -> Value {
    json!({
        "name": name, "ph": "X", "pid": 1, "tid": tid,
        "ts": start_s * 1e6, "dur": dur_s * 1e6, "args": args,
    })
}

fn track(tid: u64, name: &str) -> Value {
    json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
}

/// The trace of `steps` (each laid out at its own start), with `cards` card tracks.
pub fn chrome_trace(steps: &[&StepRecord], cards: usize) -> Value {
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "modeled deployment"}}),
        track(DEVICE, "attention device"),
        track(OUT, "network: rows out"),
        track(BACK, "network: sums back"),
    ];
    for c in 0..cards {
        events.push(track(FIRST_CARD + c as u64, &format!("card {c}")));
    }
    for s in steps {
        let d = &s.modeled.detail;
        let step_args = json!({
            "node": s.node, "tokens": s.tokens, "sequences": s.sequences,
            "prefill_tokens": s.prefill_tokens, "micro_batches": s.modeled.micro_batches.len(),
            "step_ms": d.time.seconds * 1e3, "bound": d.time.bound,
        });
        events.push(slice(
            "embedding".into(),
            DEVICE,
            s.start,
            d.time.embedding_seconds,
            step_args.clone(),
        ));
        let mut layer_start = s.start + d.time.embedding_seconds;
        for (l, layer) in d.layers.iter().enumerate() {
            let mut device_free = layer_start;
            for (m, mb) in layer.micro_batches.iter().enumerate() {
                let args = json!({"layer": l, "micro_batch": m});
                events.push(slice(
                    format!("attention L{l} mb{m}"),
                    DEVICE,
                    device_free,
                    mb.device,
                    args.clone(),
                ));
                let sent = device_free + mb.device;
                device_free = sent;
                if cards == 0 {
                    continue;
                }
                events.push(slice(
                    format!("rows L{l} mb{m}"),
                    OUT,
                    sent,
                    mb.send,
                    args.clone(),
                ));
                let arrived = sent + mb.send;
                let mut slowest = 0.0f64;
                for (c, &t) in mb.cards.iter().enumerate() {
                    if t > 0.0 {
                        events.push(slice(
                            format!("experts L{l} mb{m}"),
                            FIRST_CARD + c as u64,
                            arrived,
                            t,
                            args.clone(),
                        ));
                    }
                    slowest = slowest.max(t);
                }
                events.push(slice(
                    format!("sums L{l} mb{m}"),
                    BACK,
                    arrived + slowest,
                    mb.receive,
                    args,
                ));
            }
            layer_start += layer.period;
        }
        let tail = d.time.layers_seconds - d.layers.iter().map(|l| l.period).sum::<f64>();
        events.push(slice(
            "LM head".into(),
            DEVICE,
            layer_start + tail.max(0.0),
            d.time.lm_head_seconds,
            step_args,
        ));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ns"})
}

/// The steps worth drawing from a run: the first step with a prompt chunk, and the first
/// `count` decode-only steps after it with the most micro-batches (where the overlap shows).
pub fn pick_steps(steps: &[StepRecord], count: usize) -> Vec<&StepRecord> {
    let mut picked: Vec<&StepRecord> = Vec::new();
    if let Some(p) = steps.iter().find(|s| s.prefill_tokens > 0 && !s.failed) {
        picked.push(p);
    }
    let most = steps
        .iter()
        .filter(|s| s.prefill_tokens == 0 && !s.failed)
        .map(|s| s.modeled.micro_batches.len())
        .max()
        .unwrap_or(0);
    let decode = steps
        .iter()
        .filter(|s| s.prefill_tokens == 0 && !s.failed && s.modeled.micro_batches.len() == most);
    picked.extend(decode.take(count));
    picked
}
