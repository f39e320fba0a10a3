//! What an emulation adds to afd-loadtest's result (its `emulation` object): the deployment
//! and its profiles, the steps it made, where their time went, and how busy each card was.

use serde_json::{Value, json};

use crate::Emulation;
use crate::sim::{SimOutcome, StepRecord};

/// Mean of a step field over `steps`, in ms.
fn mean_ms(steps: &[&StepRecord], field: impl Fn(&StepRecord) -> f64) -> f64 {
    if steps.is_empty() {
        return 0.0;
    }
    1e3 * steps.iter().map(|s| field(s)).sum::<f64>() / steps.len() as f64
}

/// Where the time of `steps` went, mean per step in ms.
fn breakdown(steps: &[&StepRecord]) -> Value {
    let layers = |s: &StepRecord| s.modeled.detail.layers.len() as f64;
    json!({
        "steps": steps.len(),
        "step_ms": mean_ms(steps, |s| s.modeled.detail.time.seconds),
        "embedding_ms": mean_ms(steps, |s| s.modeled.detail.time.embedding_seconds),
        "layers_ms": mean_ms(steps, |s| s.modeled.detail.time.layers_seconds),
        "lm_head_ms": mean_ms(steps, |s| s.modeled.detail.time.lm_head_seconds),
        "attention_device_ms": mean_ms(steps, |s| s.modeled.detail.time.device_per_layer * layers(s)),
        "transfers_ms": mean_ms(steps, |s| s.modeled.detail.time.transfer_per_layer * layers(s)),
        "slowest_card_ms": mean_ms(steps, |s| s.modeled.detail.time.card_per_layer * layers(s)),
        "attention_device_idle_ms": mean_ms(steps, |s| s.modeled.detail.time.device_idle_seconds),
        "overlap_hidden_ms": mean_ms(steps, |s| s.modeled.detail.time.overlap_hidden_seconds),
        "tokens": if steps.is_empty() { 0.0 } else {
            steps.iter().map(|s| s.tokens as f64).sum::<f64>() / steps.len() as f64
        },
        "two_micro_batch_share": if steps.is_empty() { 0.0 } else {
            steps.iter().filter(|s| s.modeled.micro_batches.len() == 2).count() as f64
                / steps.len() as f64
        },
    })
}

/// The `emulation` object of an emulated run's result.
pub fn summary(e: &Emulation, sim: &SimOutcome) -> Value {
    let profiles = e.model.profiles();
    let all: Vec<&StepRecord> = sim.steps.iter().filter(|s| !s.failed).collect();
    let decode: Vec<&StepRecord> = all
        .iter()
        .copied()
        .filter(|s| s.prefill_tokens == 0)
        .collect();
    let prefill: Vec<&StepRecord> = all
        .iter()
        .copied()
        .filter(|s| s.prefill_tokens > 0)
        .collect();
    // Decode steps at the run's full batch: what a planner's "decode step at batch B" is.
    let widest = decode.iter().map(|s| s.sequences).max().unwrap_or(0);
    let full: Vec<&StepRecord> = decode
        .iter()
        .copied()
        .filter(|s| s.sequences == widest)
        .collect();
    let cards = e.model.cards().map_or(0, |c| c.len());
    let mut busy = vec![0.0f64; cards];
    for s in &all {
        for (b, x) in busy
            .iter_mut()
            .zip(&s.modeled.detail.time.card_busy_seconds)
        {
            *b += x;
        }
    }
    let mean_busy = busy.iter().sum::<f64>() / cards.max(1) as f64;
    let hottest = busy.iter().copied().fold(0.0, f64::max);
    let mut bounds = std::collections::BTreeMap::<String, usize>::new();
    for s in &all {
        *bounds
            .entry(s.modeled.detail.time.bound.clone())
            .or_default() += 1;
    }
    let fault = e.fault.as_ref().map(|f| {
        let state = crate::faults::FaultState::new(f.clone(), &e.model);
        let failed = sim.outcomes.iter().filter(|o| !o.success).count();
        json!({
            "card": f.card,
            "down_at_s": f.at.as_secs_f64(),
            "detected_at_s": state.detected().as_secs_f64(),
            "back_at_s": state.back().map(|b| b.as_secs_f64()),
            "recovery_s": state.back().map(|b| (b - f.at).as_secs_f64()),
            "reload_s": state.reload_seconds(),
            "covered_by_replicas": state.covered(),
            "failed_requests": failed,
            "failed_steps": sim.steps.iter().filter(|s| s.failed).count(),
        })
    });
    json!({
        "deployment": e.deployment,
        "profiles": {
            "attention_device": profiles.device.name,
            "card": profiles.card.name,
            "network": profiles.network.name,
        },
        "routing": e.routing.to_string(),
        "attention_nodes": e.nodes,
        "cards": cards,
        "steps": {
            "all": breakdown(&all),
            "decode_only": breakdown(&decode),
            "full_batch_decode": breakdown(&full),
            "with_prefill": breakdown(&prefill),
            "failed": sim.steps.len() - all.len(),
            "bound_by": bounds,
        },
        "card_busy": {
            "seconds": busy,
            "utilization": busy.iter().map(|b| if sim.duration > 0.0 { b / sim.duration } else { 0.0 }).collect::<Vec<_>>(),
            "hottest_over_mean": if mean_busy > 0.0 { hottest / mean_busy } else { 0.0 },
        },
        "fault": fault,
    })
}
