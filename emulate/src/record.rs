//! Recorded routing: how many tokens each expert of each layer received, per window of steps.
//!
//! `afd emulate --routing model --record-routing FILE` (and the serving path that records the
//! same way) writes one JSON object, which `--routing trace:FILE` reads back:
//!
//! ```json
//! {
//!   "format": "afd-routing-counts/1",
//!   "layers": 24, "experts": 32, "top_k": 4, "window_steps": 256,
//!   "windows": [
//!     {"first_step": 0, "steps": 256, "tokens": 9000, "counts": [[12, 0, 31, ...], [], ...]}
//!   ]
//! }
//! ```
//!
//! `counts[layer][expert]` is the number of tokens of the window's steps (prefill and decode)
//! that chose that expert among their top-k; a dense layer's list is empty. `tokens` counts the
//! tokens routed in the window (each appears `top_k` times in a MoE layer's counts).

use std::path::Path;

use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use step::{
    AttentionNode, HealthSource, KvCapacity, SeqId, StepBatch, StepError, StepOutput, StepRouting,
};

use crate::error::{Error, Result};

/// The format tag written into every file.
pub const FORMAT: &str = "afd-routing-counts/1";

/// Counts of one window of steps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingWindow {
    /// The window's first step (counting from 0).
    pub first_step: u64,
    /// Steps in the window.
    pub steps: u64,
    /// Tokens routed in the window.
    pub tokens: u64,
    /// `counts[layer][expert]`; empty for a dense layer.
    pub counts: Vec<Vec<u64>>,
}

/// A routing record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingCounts {
    /// [`FORMAT`].
    pub format: String,
    /// Decoder layers.
    pub layers: usize,
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Steps per window (the last window may hold fewer).
    pub window_steps: u64,
    /// The windows, in order.
    pub windows: Vec<RoutingWindow>,
}

impl RoutingCounts {
    /// Reads a record, checking its format tag.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!(
                "cannot read the routing record {}: {e}",
                path.display()
            ))
        })?;
        let counts: RoutingCounts = serde_json::from_str(&text).map_err(|e| {
            Error::Config(format!(
                "{} is not a routing record ({e}); write one with `afd emulate --routing model \
                 --record-routing FILE`",
                path.display()
            ))
        })?;
        if counts.format != FORMAT {
            return Err(Error::Config(format!(
                "{}: format `{}`, expected `{FORMAT}`",
                path.display(),
                counts.format
            )));
        }
        Ok(counts)
    }

    /// Writes the record as pretty JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Config(format!("cannot write the routing record: {e}")))?;
        std::fs::write(path, text).map_err(|e| {
            Error::Config(format!(
                "cannot write the routing record {}: {e}",
                path.display()
            ))
        })
    }

    /// Checks that the record is of a model with `layers` layers of `experts` experts.
    pub fn check_shape(&self, layers: usize, experts: usize, path: &Path) -> Result<()> {
        if self.layers != layers || self.experts != experts {
            return Err(Error::Config(format!(
                "{} records {} layers of {} experts, but the deployment's model has {layers} \
                 layers of {experts}: record the routing of the same model",
                path.display(),
                self.layers,
                self.experts
            )));
        }
        Ok(())
    }

    /// Tokens per expert of `layer` over every window (empty for a dense layer).
    pub fn totals(&self, layer: usize) -> Vec<u64> {
        let mut total = Vec::new();
        for w in &self.windows {
            let Some(c) = w.counts.get(layer) else {
                continue;
            };
            if total.len() < c.len() {
                total.resize(c.len(), 0);
            }
            for (t, x) in total.iter_mut().zip(c) {
                *t += x;
            }
        }
        total
    }

    /// Per MoE layer, the hottest expert's load over the mean load (1.0 is perfectly even).
    pub fn hottest_over_mean(&self) -> Vec<f64> {
        (0..self.layers)
            .filter_map(|l| {
                let t = self.totals(l);
                let sum: u64 = t.iter().sum();
                (sum > 0).then(|| {
                    let max = t.iter().copied().max().unwrap_or(0) as f64;
                    max / (sum as f64 / t.len() as f64)
                })
            })
            .collect()
    }
}

/// Counts each step's routing into windows of `window_steps` steps.
#[derive(Debug, Clone)]
pub struct RoutingRecorder {
    counts: RoutingCounts,
    moe: Vec<bool>,
    steps: u64,
}

impl RoutingRecorder {
    /// A recorder for a model of `moe_layers` (true for each MoE layer), `experts` experts,
    /// `top_k` per token.
    pub fn new(moe_layers: &[bool], experts: usize, top_k: usize, window_steps: u64) -> Self {
        RoutingRecorder {
            counts: RoutingCounts {
                format: FORMAT.into(),
                layers: moe_layers.len(),
                experts,
                top_k,
                window_steps: window_steps.max(1),
                windows: Vec::new(),
            },
            moe: moe_layers.to_vec(),
            steps: 0,
        }
    }

    /// Adds one step's routing.
    pub fn observe(&mut self, routing: &StepRouting) {
        let c = &mut self.counts;
        if self.steps.is_multiple_of(c.window_steps) {
            c.windows.push(RoutingWindow {
                first_step: self.steps,
                steps: 0,
                tokens: 0,
                counts: self
                    .moe
                    .iter()
                    .map(|&m| if m { vec![0; c.experts] } else { Vec::new() })
                    .collect(),
            });
        }
        self.steps += 1;
        let Some(w) = c.windows.last_mut() else {
            return;
        };
        w.steps += 1;
        w.tokens += (0..c.layers).map(|l| routing.tokens(l)).max().unwrap_or(0) as u64;
        for (layer, experts) in routing.layers.iter().enumerate() {
            let (Some(experts), Some(counts)) = (experts, w.counts.get_mut(layer)) else {
                continue;
            };
            for &e in experts {
                if let Some(n) = counts.get_mut(e as usize) {
                    *n += 1;
                }
            }
        }
    }

    /// The record so far.
    pub fn counts(&self) -> &RoutingCounts {
        &self.counts
    }
}

/// Whoever counts the routing of a [`RecordingNode`]'s steps.
pub trait RoutingObserver: Send + Sync {
    /// One successful step's routing.
    fn observe(&self, routing: &StepRouting);
}

impl RoutingObserver for Mutex<RoutingRecorder> {
    fn observe(&self, routing: &StepRouting) {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .observe(routing);
    }
}

/// An attention node whose every step's routing is counted by an observer (a shared recorder
/// for `afd serve --record-routing`, the `--eplb` window): it asks the node it wraps to report
/// routing, counts it, and still hands it on to whoever takes it next (a modeled clock).
pub struct RecordingNode {
    inner: Box<dyn AttentionNode>,
    recorder: Arc<dyn RoutingObserver>,
    last: Option<StepRouting>,
    /// Whether someone besides the recorder asked for the routing.
    handing_on: bool,
}

impl RecordingNode {
    /// `inner`, its routing counted by `recorder`.
    pub fn new(mut inner: Box<dyn AttentionNode>, recorder: Arc<dyn RoutingObserver>) -> Self {
        inner.record_routing(true);
        RecordingNode {
            inner,
            recorder,
            last: None,
            handing_on: false,
        }
    }
}

impl AttentionNode for RecordingNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.inner.kv_capacity()
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        let out = self.inner.step(batch);
        let routing = self.inner.take_routing();
        if let (Ok(_), Some(r)) = (&out, &routing) {
            self.recorder.observe(r);
        }
        self.last = routing.filter(|_| self.handing_on);
        out
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        self.inner.free(seqs)
    }

    fn shares_kv_blocks(&self) -> bool {
        self.inner.shares_kv_blocks()
    }

    fn health_source(&self) -> Option<Arc<dyn HealthSource>> {
        self.inner.health_source()
    }

    fn record_routing(&mut self, on: bool) {
        self.handing_on = on;
    }

    fn take_routing(&mut self) -> Option<StepRouting> {
        self.last.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_counts_windows_and_round_trips() {
        let mut r = RoutingRecorder::new(&[true, false], 4, 2, 2);
        for step in 0..5u32 {
            r.observe(&StepRouting {
                top_k: 2,
                layers: vec![Some(vec![step % 4, 3, 0, 1]), None],
            });
        }
        let c = r.counts().clone();
        assert_eq!(c.windows.len(), 3);
        assert_eq!(
            c.windows.iter().map(|w| w.steps).collect::<Vec<_>>(),
            [2, 2, 1]
        );
        assert_eq!(c.windows[0].tokens, 4);
        assert_eq!(c.totals(0), vec![7, 6, 1, 6]);
        assert!(c.totals(1).is_empty());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        c.write(&path).unwrap();
        assert_eq!(RoutingCounts::read(&path).unwrap(), c);
        assert!(c.check_shape(2, 4, &path).is_ok());
        let e = c.check_shape(24, 32, &path).unwrap_err().to_string();
        assert!(e.contains("2 layers of 4 experts"), "{e}");
        std::fs::write(&path, "{\"format\": \"other\"}").unwrap();
        assert!(RoutingCounts::read(&path).is_err());
    }

    /// A recording node counts every step's routing and still hands it on when asked to.
    #[test]
    fn a_recording_node_counts_and_hands_on() {
        use crate::node::SyntheticNode;
        use crate::routing::{RoutingGenerator, RoutingSource};
        let generator =
            RoutingGenerator::new(&RoutingSource::Uniform, &[true, true], 8, 2, 1).unwrap();
        let kv = KvCapacity {
            block_size: 4,
            num_blocks: 16,
        };
        let recorder = Arc::new(Mutex::new(RoutingRecorder::new(&[true, true], 8, 2, 10)));
        let mut node = RecordingNode::new(
            Box::new(SyntheticNode::new(kv, Some(generator), 7)),
            recorder.clone(),
        );
        let batch = StepBatch {
            entries: vec![step::StepEntry {
                seq: 1,
                tokens: vec![1, 2, 3],
                start: 0,
                prompt_len: 3,
                block_table: vec![0],
                sample: None,
                cached_prefix: Vec::new(),
                prompt_logprobs: None,
            }],
        };
        node.step(&batch).unwrap();
        assert!(node.take_routing().is_none(), "nobody asked for it");
        node.record_routing(true);
        node.step(&batch).unwrap();
        let handed = node.take_routing().unwrap();
        assert_eq!(handed.tokens(0), 3);
        let counts = recorder.lock().unwrap().counts().clone();
        assert_eq!(counts.windows[0].steps, 2);
        assert_eq!(counts.totals(1).iter().sum::<u64>(), 2 * 3 * 2);
    }
}
