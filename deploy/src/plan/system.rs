//! The system performance model: one decode step (and a prefill) of a deployment, from the
//! attention device's kernels, the JetStream transfers, the cards' modeled programs, the
//! micro-batch overlap and the LM head.
//!
//! Per layer and attention node, with `m` micro-batches of `n` tokens each:
//! - `g`: the device's kernels for one micro-batch (attention half, dispatch, combine);
//! - `r`: its round trip: a JetStream write out (hop latency + bytes / NIC bandwidth), the
//!   slowest card's modeled layer time, the write back;
//! - the layer's period is the largest of `m * g` (the device is busy), `g + r` (a micro-batch
//!   waits for its own round trip), the cards' busy time (every node's micro-batches run on
//!   them one after the other) and the card-side NICs' busy time.
//!
//! With one micro-batch that is `g + r`: nothing overlaps. The GPU alone runs every layer's
//! kernels back to back, the MoE on the device. The LM head's shard streams from LPDDR while
//! the layers run (seed 004), so only what the stream does not hide, plus its arithmetic and
//! transfers, is added after the last layer.

use gpu_attention::MicroBatches;
use model::ModelConfig;
use serde::{Deserialize, Serialize};

use super::cards::CardSet;
use super::gpu::{self, FfnPlace, TokenGroup};
use super::profiles::{DeviceProfile, NetworkProfile};

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
}

impl System<'_> {
    /// One step of `batch` sequences over all nodes, each adding `tokens_per_seq` tokens at
    /// an average attention span of `context` keys. Decode: `tokens_per_seq = 1`. Under
    /// `auto` the faster of one and two micro-batches, as the node picks it by measuring both.
    pub fn step(&self, batch: usize, tokens_per_seq: usize, context: f64) -> StepTime {
        let per_node = batch.div_ceil(self.nodes.max(1));
        if self.cards.is_none() || per_node < 2 {
            return self.step_with(1, batch, tokens_per_seq, context);
        }
        match self.micro_batches {
            MicroBatches::One => self.step_with(1, batch, tokens_per_seq, context),
            MicroBatches::Two => self.step_with(2, batch, tokens_per_seq, context),
            MicroBatches::Auto => {
                let one = self.step_with(1, batch, tokens_per_seq, context);
                let two = self.step_with(2, batch, tokens_per_seq, context);
                if two.seconds < one.seconds { two } else { one }
            }
        }
    }

    /// [`System::step`] with `m` micro-batches per node.
    fn step_with(&self, m: usize, batch: usize, tokens_per_seq: usize, context: f64) -> StepTime {
        let per_node = batch.div_ceil(self.nodes.max(1));
        let seqs = per_node.div_ceil(m);
        let group = TokenGroup {
            tokens: seqs * tokens_per_seq,
            sequences: seqs,
            context,
        };
        let layers = self.model.num_layers();
        let h = self.model.hidden_size as f64;
        let k = self.model.moe.map_or(0, |m| m.top_k) as f64;
        let wire = self.wire_bytes as f64;
        let node_bw = self.network.nic_bandwidth * self.network.nics_per_attention_node as f64;
        let hop = self.network.hop_latency_ns * 1e-9;
        let mut t = StepTime {
            micro_batches: m,
            micro_batch_tokens: group.tokens,
            ..StepTime::default()
        };
        let mut bounds = [0usize; 5];
        let mut card_lpddr = 0.0;
        let mut last_tail = 0.0;
        for l in 0..layers {
            let Some(cards) = self.cards else {
                let g = gpu::seconds(
                    &gpu::layer_kernels(self.model, l, group, FfnPlace::Device, self.device),
                    self.device,
                );
                t.layers_seconds += g;
                t.device_per_layer += g;
                bounds[0] += 1;
                continue;
            };
            let d = cards.cards_per_token_milli(l);
            let ffn = FfnPlace::Cards {
                cards_per_token_milli: d,
                wire_bytes: self.wire_bytes as u64,
            };
            let g = gpu::seconds(
                &gpu::layer_kernels(self.model, l, group, ffn, self.device),
                self.device,
            );
            let rows = group.tokens as f64 * d as f64 / 1000.0;
            let out = rows * (h * wire + k * 8.0);
            let back = rows * h * wire;
            let transfer = 2.0 * hop + (out + back) / node_bw;
            let card = cards.layer_time(l, group.tokens);
            let r = transfer + card.seconds;
            let calls = (self.nodes * m) as f64;
            let card_nics = cards.len().div_ceil(self.network.cards_per_nic) as f64;
            // NICs are full duplex: writes out and back of different micro-batches overlap.
            let terms = [
                m as f64 * g,
                g + r,
                calls * card.seconds,
                calls * out.max(back) / (card_nics * self.network.nic_bandwidth),
                m as f64 * out.max(back) / node_bw,
            ];
            let (which, period) = terms
                .iter()
                .copied()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((0, 0.0));
            bounds[which] += 1;
            t.layers_seconds += period;
            t.device_per_layer += m as f64 * g;
            t.transfer_per_layer += transfer;
            t.card_per_layer += card.seconds;
            card_lpddr += calls * card.lpddr_seconds;
            // The last layer ends when the last micro-batch's round trip does.
            last_tail = (m as f64 * g + r - period).max(0.0);
        }
        t.layers_seconds += last_tail;
        let n = layers.max(1) as f64;
        t.device_per_layer /= n;
        t.transfer_per_layer /= n;
        t.card_per_layer /= n;
        const NAMES: [&str; 5] = [
            "attention device",
            "round trip",
            "cards",
            "card NICs",
            "attention node's NIC",
        ];
        let most = (0..NAMES.len()).max_by_key(|&i| bounds[i]).unwrap_or(0);
        t.bound = NAMES[most].to_string();

        // Rows that need a next token: the last of each sequence, over the whole node.
        let rows = per_node;
        t.embedding_seconds = gpu::seconds(
            &gpu::embedding_kernels(self.model, per_node * tokens_per_seq, self.device),
            self.device,
        );
        match self.cards {
            None => {
                t.lm_head_seconds = gpu::seconds(
                    &gpu::head_kernels(self.model, rows, false, self.device),
                    self.device,
                );
            }
            Some(cards) => {
                let device = gpu::seconds(
                    &gpu::head_kernels(self.model, rows, true, self.device),
                    self.device,
                );
                let c = cards.len() as f64;
                let out = c * rows as f64 * (h * wire + ROW_SAMPLING_BYTES);
                let back = c * rows as f64 * self.lm_head_candidates as f64 * CANDIDATE_BYTES;
                let transfer = 2.0 * hop + (out + back) / node_bw;
                let lm = cards.lm_head_time(rows);
                let nodes = self.nodes as f64;
                // The shard streams while the layers run, unless spilled weights keep LPDDR busy.
                let window = (t.layers_seconds - card_lpddr).max(0.0);
                t.lm_head_exposed_stream = (nodes * lm.lpddr_seconds - window).max(0.0);
                let arithmetic = nodes * (lm.seconds - lm.lpddr_seconds);
                t.lm_head_seconds = device + transfer + arithmetic + t.lm_head_exposed_stream;
            }
        }
        t.seconds = t.embedding_seconds + t.layers_seconds + t.lm_head_seconds;
        t
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
