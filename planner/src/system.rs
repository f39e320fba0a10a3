//! The system performance model: one step of a deployment, from the attention device's kernels,
//! the JetStream transfers, the cards' modeled programs, the micro-batch overlap and the LM head.
//!
//! One function, [`System::step_time`], times a step described by a [`StepShape`]: its
//! micro-batches (tokens, sequences and how they attend) and where each layer's rows went
//! (uniform routing in expectation, or the rows each card was actually sent). The planner
//! applies it to its uniform batch ([`System::step`]); the emulation to the steps its scheduler
//! makes, with the routing the model (or a routing generator) produced. So the two cannot drift.
//!
//! Per layer and attention node, with micro-batches `i` of the step:
//! - `g_i`: the device's kernels for micro-batch `i` (attention half, dispatch, combine);
//! - `r_i`: its round trip: a JetStream write out (hop latency + bytes / NIC bandwidth), the
//!   slowest card's modeled time for its rows, the write back;
//! - the layer's period is the largest of `sum g_i` (the device is busy), `g_i + r_i` (a
//!   micro-batch waits for its own round trip), each card's busy time (every node's
//!   micro-batches run on it one after the other), and the card-side and node-side NICs' busy
//!   time.
//!
//! With one micro-batch that is `g + r`: nothing overlaps. The GPU alone runs every layer's
//! kernels back to back, the MoE on the device. The LM head's shard streams from LPDDR while
//! the layers run (seed 004), so only what the stream does not hide, plus its arithmetic and
//! transfers, is added after the last layer.
//!
//! Attention nodes sharing the cards are assumed to load them as the node being timed does
//! (the planner's symmetric assumption); [`StepShape::nodes`] says how many do at the time.

use model::ModelConfig;
use serde::{Deserialize, Serialize};
use step::MicroBatches;

use super::cards::CardSet;
use super::gpu::{self, Attending, FfnPlace, Span, TokenGroup};
use super::profiles::{DeviceProfile, NetworkProfile};
use corsair_ffn::perf::LayerTime;

/// Bytes of the per-row sampling settings sent with each LM-head row (proto's row sampling).
const ROW_SAMPLING_BYTES: f64 = 16.0;
/// Bytes of one LM-head candidate (logit and token id).
const CANDIDATE_BYTES: f64 = 8.0;

/// What the system model needs besides the workload.
#[derive(Debug, Clone, Copy)]
pub struct System<'a> {
    /// The model's shape.
    pub model: &'a ModelConfig,
    /// The attention device.
    pub device: &'a DeviceProfile,
    /// The data plane.
    pub network: &'a NetworkProfile,
    /// The cards (`None`: the device runs the whole model).
    pub cards: Option<&'a CardSet>,
    /// Attention nodes sharing the cards.
    pub nodes: usize,
    /// Micro-batches per step.
    pub micro_batches: MicroBatches,
    /// Bytes per hidden element on the wire.
    pub wire_bytes: usize,
    /// Most tokens per step (prefill chunks).
    pub chunk_tokens: usize,
    /// LM-head candidates each card returns per row.
    pub lm_head_candidates: usize,
}

/// One card's rows of one layer and micro-batch, as dispatched.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CardRows {
    /// The card.
    pub card: usize,
    /// Tokens sent to it.
    pub rows: usize,
    /// Rows per local expert, in its program's order ([`CardSet::local_experts_of`]); empty
    /// for a dense layer.
    pub expert_rows: Vec<usize>,
}

/// Where a micro-batch's rows went, layer by layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing<'a> {
    /// Uniform routing in expectation (the planner's): every card's mean time, the slowest
    /// card's mean time and the mean rows sent over many draws of the routing
    /// ([`crate::expected`]).
    Expected,
    /// As dispatched: per layer, the cards that were sent rows (cards absent got nothing).
    Observed(&'a [Vec<CardRows>]),
}

/// One micro-batch of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatchShape<'a> {
    /// Its tokens and how they attend.
    pub group: TokenGroup<'a>,
    /// Where its rows went.
    pub routing: Routing<'a>,
}

/// One step of one attention node, as the model times it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepShape<'a> {
    /// Its micro-batches, in order (one, or two with overlap).
    pub micro_batches: Vec<MicroBatchShape<'a>>,
    /// Rows that need a next token (the LM head's rows).
    pub sample_rows: usize,
    /// Attention nodes sharing the cards while this step runs (at least 1).
    pub nodes: usize,
}

/// Where the time of one step goes (seconds).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// The whole step.
    pub seconds: f64,
    /// Decoder layers (periods summed, plus the last layer's tail).
    pub layers_seconds: f64,
    /// The attention device's kernels per layer (all micro-batches of one node), mean.
    pub device_per_layer: f64,
    /// One micro-batch's JetStream writes out and back per layer, mean.
    pub transfer_per_layer: f64,
    /// The slowest card's modeled time for one micro-batch per layer, mean.
    pub card_per_layer: f64,
    /// After the last layer: final norm, LM head (cards or device), proposals.
    pub lm_head_seconds: f64,
    /// Of the cards' LM-head stream from LPDDR, what the layers did not hide.
    pub lm_head_exposed_stream: f64,
    /// The embedding lookup.
    pub embedding_seconds: f64,
    /// Micro-batches per node.
    pub micro_batches: usize,
    /// Tokens per micro-batch (the larger one).
    pub micro_batch_tokens: usize,
    /// What bounds most layers: `attention device`, `round trip`, `cards`, `card NICs` or
    /// `attention node's NIC`.
    pub bound: String,
    /// Each card's modeled busy time in the layers for this node's rows (its own rows, not
    /// scaled by the nodes sharing it); empty without cards.
    #[serde(default)]
    pub card_busy_seconds: Vec<f64>,
    /// Time in the layers the attention device waited: the layers less its kernels.
    #[serde(default)]
    pub device_idle_seconds: f64,
    /// What the micro-batch overlap hid: the layers as one micro-batch after the other would
    /// take (each its kernels then its round trip), less the layers as they ran.
    #[serde(default)]
    pub overlap_hidden_seconds: f64,
}

/// One micro-batch's part of one layer (seconds), for timelines.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchLayer {
    /// The device's kernels.
    pub device: f64,
    /// The JetStream write out (hop and bytes).
    pub send: f64,
    /// The write back.
    pub receive: f64,
    /// Each card's modeled time for its rows (0: sent nothing), in card order.
    pub cards: Vec<f64>,
}

/// One layer of a step, for timelines.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerDetail {
    /// The layer's period: when the next layer starts after this one did.
    pub period: f64,
    /// Per micro-batch.
    pub micro_batches: Vec<MicroBatchLayer>,
}

/// A step's time with its layers in detail.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepDetail {
    /// The totals.
    pub time: StepTime,
    /// Per decoder layer.
    pub layers: Vec<LayerDetail>,
}

const BOUNDS: [&str; 5] = [
    "attention device",
    "round trip",
    "cards",
    "card NICs",
    "attention node's NIC",
];

/// What one micro-batch costs in one layer.
struct MbCost {
    g: f64,
    send: f64,
    receive: f64,
    out_bytes: f64,
    back_bytes: f64,
    /// Per card; empty without cards.
    cards: Vec<LayerTime>,
    slowest: LayerTime,
}

impl System<'_> {
    /// One step of the planner's uniform batch: `batch` sequences over all nodes, each adding
    /// `tokens_per_seq` tokens at an average attention span of `context` keys. Decode:
    /// `tokens_per_seq = 1`. Under `auto` the faster of one and two micro-batches, as the node
    /// picks it by measuring both.
    pub fn step(&self, batch: usize, tokens_per_seq: usize, context: f64) -> StepTime {
        let per_node = batch.div_ceil(self.nodes.max(1));
        let uniform = |m: usize| self.uniform_step(m, per_node, tokens_per_seq, context).time;
        if self.cards.is_none() || per_node < 2 {
            return uniform(1);
        }
        match self.micro_batches {
            MicroBatches::One => uniform(1),
            MicroBatches::Two => uniform(2),
            MicroBatches::Auto => {
                let one = uniform(1);
                let two = uniform(2);
                if two.seconds < one.seconds { two } else { one }
            }
        }
    }

    /// The planner's uniform step of one node with `m` micro-batches of equal size.
    fn uniform_step(
        &self,
        m: usize,
        per_node: usize,
        tokens_per_seq: usize,
        context: f64,
    ) -> StepDetail {
        let seqs = per_node.div_ceil(m);
        let mb = MicroBatchShape {
            group: TokenGroup {
                tokens: seqs * tokens_per_seq,
                sequences: seqs,
                attending: Attending::Uniform { context },
            },
            routing: Routing::Expected,
        };
        self.step_time(&StepShape {
            micro_batches: vec![mb; m],
            sample_rows: per_node,
            nodes: self.nodes,
        })
    }

    /// The modeled time of one step of one node, with its layers in detail.
    pub fn step_time(&self, shape: &StepShape<'_>) -> StepDetail {
        let layers = self.model.num_layers();
        let nodes = shape.nodes.max(1) as f64;
        let m = shape.micro_batches.len();
        let node_bw = self.network.nic_bandwidth * self.network.nics_per_attention_node as f64;
        let mut t = StepTime {
            micro_batches: m,
            micro_batch_tokens: shape
                .micro_batches
                .iter()
                .map(|mb| mb.group.tokens)
                .max()
                .unwrap_or(0),
            card_busy_seconds: vec![0.0; self.cards.map_or(0, CardSet::len)],
            ..StepTime::default()
        };
        let mut detail = Vec::with_capacity(layers);
        let mut bounds = [0usize; BOUNDS.len()];
        let mut card_lpddr = 0.0;
        let mut last_tail = 0.0;
        for l in 0..layers {
            let costs: Vec<MbCost> = shape
                .micro_batches
                .iter()
                .map(|mb| self.micro_batch_cost(l, mb))
                .collect();
            let device: f64 = costs.iter().map(|c| c.g).sum();
            let (period, which) = if self.cards.is_none() {
                (device, 0)
            } else {
                let card_nics = self
                    .cards
                    .map_or(1, |c| c.len().div_ceil(self.network.cards_per_nic))
                    as f64;
                let wire: f64 = costs.iter().map(|c| c.out_bytes.max(c.back_bytes)).sum();
                let cards = t.card_busy_seconds.len();
                let busiest_card = (0..cards)
                    .map(|c| costs.iter().map(|mb| mb.cards[c].seconds).sum::<f64>())
                    .fold(0.0, f64::max);
                // NICs are full duplex: writes out and back of different micro-batches overlap.
                let terms = [
                    device,
                    costs
                        .iter()
                        .map(|c| c.g + c.send + c.slowest.seconds + c.receive)
                        .fold(0.0, f64::max),
                    nodes * busiest_card,
                    nodes * wire / (card_nics * self.network.nic_bandwidth),
                    wire / node_bw,
                ];
                let (which, period) = terms
                    .iter()
                    .copied()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .unwrap_or((0, 0.0));
                (period, which)
            };
            bounds[which] += 1;
            t.layers_seconds += period;
            t.device_per_layer += device;
            if self.cards.is_some() {
                let per_mb = m.max(1) as f64;
                t.transfer_per_layer +=
                    costs.iter().map(|c| c.send + c.receive).sum::<f64>() / per_mb;
                t.card_per_layer += costs.iter().map(|c| c.slowest.seconds).sum::<f64>() / per_mb;
                card_lpddr += nodes * costs.iter().map(|c| c.slowest.lpddr_seconds).sum::<f64>();
                for c in &costs {
                    for (busy, card) in t.card_busy_seconds.iter_mut().zip(&c.cards) {
                        *busy += card.seconds;
                    }
                }
                let serial: f64 = costs
                    .iter()
                    .map(|c| c.g + c.send + c.slowest.seconds + c.receive)
                    .sum();
                t.overlap_hidden_seconds += (serial - period).max(0.0);
                // The last layer ends when the last micro-batch's round trip does.
                let last_round_trip = costs
                    .last()
                    .map_or(0.0, |c| c.send + c.slowest.seconds + c.receive);
                last_tail = (device + last_round_trip - period).max(0.0);
            }
            detail.push(LayerDetail {
                period,
                micro_batches: costs
                    .into_iter()
                    .map(|c| MicroBatchLayer {
                        device: c.g,
                        send: c.send,
                        receive: c.receive,
                        cards: c.cards.iter().map(|t| t.seconds).collect(),
                    })
                    .collect(),
            });
        }
        t.layers_seconds += last_tail;
        t.device_idle_seconds = (t.layers_seconds - t.device_per_layer).max(0.0);
        let n = layers.max(1) as f64;
        t.device_per_layer /= n;
        t.transfer_per_layer /= n;
        t.card_per_layer /= n;
        let most = (0..BOUNDS.len()).max_by_key(|&i| bounds[i]).unwrap_or(0);
        t.bound = BOUNDS[most].to_string();

        let tokens: usize = shape.micro_batches.iter().map(|mb| mb.group.tokens).sum();
        t.embedding_seconds = gpu::seconds(
            &gpu::embedding_kernels(self.model, tokens, self.device),
            self.device,
        );
        t.lm_head_seconds = self.lm_head_seconds(
            shape.sample_rows,
            nodes,
            t.layers_seconds,
            card_lpddr,
            &mut t,
        );
        t.seconds = t.embedding_seconds + t.layers_seconds + t.lm_head_seconds;
        StepDetail {
            time: t,
            layers: detail,
        }
    }

    /// The LM head after the last layer for `rows` rows; sets the exposed LPDDR stream.
    fn lm_head_seconds(
        &self,
        rows: usize,
        nodes: f64,
        layers_seconds: f64,
        card_lpddr: f64,
        t: &mut StepTime,
    ) -> f64 {
        let Some(cards) = self.cards else {
            return gpu::seconds(
                &gpu::head_kernels(self.model, rows, false, self.device),
                self.device,
            );
        };
        let h = self.model.hidden_size as f64;
        let wire = self.wire_bytes as f64;
        let node_bw = self.network.nic_bandwidth * self.network.nics_per_attention_node as f64;
        let hop = self.network.hop_latency_ns * 1e-9;
        let device = gpu::seconds(
            &gpu::head_kernels(self.model, rows, true, self.device),
            self.device,
        );
        let c = cards.len() as f64;
        let out = c * rows as f64 * (h * wire + ROW_SAMPLING_BYTES);
        let back = c * rows as f64 * self.lm_head_candidates as f64 * CANDIDATE_BYTES;
        let transfer = 2.0 * hop + (out + back) / node_bw;
        let lm = cards.lm_head_time(rows);
        // The shard streams while the layers run, unless spilled weights keep LPDDR busy.
        let window = (layers_seconds - card_lpddr).max(0.0);
        t.lm_head_exposed_stream = (nodes * lm.lpddr_seconds - window).max(0.0);
        let arithmetic = nodes * (lm.seconds - lm.lpddr_seconds);
        device + transfer + arithmetic + t.lm_head_exposed_stream
    }

    /// One micro-batch's kernels, transfers and card times in layer `l`.
    fn micro_batch_cost(&self, l: usize, mb: &MicroBatchShape<'_>) -> MbCost {
        let group = mb.group;
        let Some(cards) = self.cards else {
            let g = gpu::seconds(
                &gpu::layer_kernels(self.model, l, group, FfnPlace::Device, self.device),
                self.device,
            );
            return MbCost {
                g,
                send: 0.0,
                receive: 0.0,
                out_bytes: 0.0,
                back_bytes: 0.0,
                cards: Vec::new(),
                slowest: LayerTime::default(),
            };
        };
        let h = self.model.hidden_size as f64;
        let k = self.model.moe.map_or(0, |m| m.top_k) as f64;
        let wire = self.wire_bytes as f64;
        let node_bw = self.network.nic_bandwidth * self.network.nics_per_attention_node as f64;
        let hop = self.network.hop_latency_ns * 1e-9;
        let (rows, per_card, slowest) = match mb.routing {
            Routing::Expected => {
                let e = cards.expected_layer(l, group.tokens);
                (e.rows, e.per_card.clone(), e.slowest.clone())
            }
            Routing::Observed(layers) => {
                let mut per_card = vec![LayerTime::default(); cards.len()];
                let mut rows = 0usize;
                for c in layers.get(l).map_or(&[][..], Vec::as_slice) {
                    if let Some(slot) = per_card.get_mut(c.card) {
                        *slot = cards.observed_layer_time(c.card, l, c.rows, &c.expert_rows);
                        rows += c.rows;
                    }
                }
                let slowest = per_card
                    .iter()
                    .max_by(|a, b| a.seconds.total_cmp(&b.seconds))
                    .cloned()
                    .unwrap_or_default();
                (rows as f64, per_card, slowest)
            }
        };
        let rows_per_token = if group.tokens == 0 {
            0.0
        } else {
            rows / group.tokens as f64
        };
        let ffn = FfnPlace::Cards {
            rows_per_token,
            wire_bytes: self.wire_bytes as u64,
        };
        let g = gpu::seconds(
            &gpu::layer_kernels(self.model, l, group, ffn, self.device),
            self.device,
        );
        let out = rows * (h * wire + k * 8.0);
        let back = rows * h * wire;
        MbCost {
            g,
            send: hop + out / node_bw,
            receive: hop + back / node_bw,
            out_bytes: out,
            back_bytes: back,
            cards: per_card,
            slowest,
        }
    }

    /// Seconds to prefill `batch` prompts of `input_len` tokens, in chunks of at most
    /// `chunk_tokens` tokens per node, every node in parallel.
    pub fn prefill_seconds(&self, batch: usize, input_len: usize) -> f64 {
        if input_len == 0 || batch == 0 {
            return 0.0;
        }
        let per_node = batch.div_ceil(self.nodes.max(1));
        let total = per_node * input_len;
        let chunk = self.chunk_tokens.clamp(1, total);
        let steps = total.div_ceil(chunk);
        // A chunk holds whole prompts when they are short, part of one when they are long.
        let (seqs, tokens_per_seq) = if input_len <= chunk {
            (chunk / input_len, input_len)
        } else {
            (1, chunk)
        };
        // Causal attention: a prompt's tokens see half of it on average. A chunk of several
        // prompts splits into micro-batches like a decode step.
        let s = self.step(seqs * self.nodes, tokens_per_seq, input_len as f64 / 2.0);
        // Every chunk runs the layers; the LM head runs once, for the last tokens.
        steps as f64 * (s.seconds - s.lm_head_seconds) + s.lm_head_seconds
    }
}

/// The spans of `entries` (new tokens, tokens before them), for [`Attending::Spans`].
pub fn spans(entries: impl IntoIterator<Item = (usize, usize)>) -> Vec<Span> {
    entries
        .into_iter()
        .map(|(new, past)| Span { new, past })
        .collect()
}
