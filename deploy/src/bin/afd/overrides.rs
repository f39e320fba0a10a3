//! Flags that override single keys of a deployment file, shared by `afd plan` and
//! `afd emulate` (each named as the key it sets, vLLM's name where one exists).

use deploy::deployment::{Deployment, MicroBatchSetting};
use gpu_attention::MicroBatches;
use planner::ReplicateExperts;

/// Overrides of deployment-file keys.
#[derive(Debug, Clone, clap::Args)]
pub struct DeploymentOverrides {
    /// Override `cards.count` (0: the attention device alone).
    #[arg(long)]
    pub cards: Option<usize>,
    /// Override `attention.nodes`.
    #[arg(long)]
    pub attention_nodes: Option<usize>,
    /// Override `attention.profile` (h100, h200 or a profile file).
    #[arg(long)]
    pub profile: Option<String>,
    /// Override `attention.max_num_seqs`.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Override `attention.max_model_len`.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Override `attention.max_num_batched_tokens`.
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Override `model.format` (as-stored, bf16, mxfp4, mxint8).
    #[arg(long)]
    pub format: Option<corsair_ffn::FormatChoice>,
    /// Override `cards.allow_spill`.
    #[arg(long)]
    pub allow_spill: Option<bool>,
    /// Override `cards.replicate_experts` (auto, true or false).
    #[arg(long)]
    pub replicate_experts: Option<ReplicateExperts>,
    /// Override `overlap.micro_batches` (1, 2 or auto).
    #[arg(long)]
    pub micro_batches: Option<MicroBatches>,
}

impl DeploymentOverrides {
    /// Sets the keys given on the command line.
    pub fn apply(&self, d: &mut Deployment) {
        let set = |slot: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut d.cards.count, self.cards);
        set(&mut d.attention.nodes, self.attention_nodes);
        set(&mut d.attention.max_num_seqs, self.max_num_seqs);
        set(&mut d.attention.max_model_len, self.max_model_len);
        set(
            &mut d.attention.max_num_batched_tokens,
            self.max_num_batched_tokens,
        );
        if let Some(profile) = &self.profile {
            d.attention.profile = profile.clone();
        }
        if let Some(f) = self.format {
            d.model.format = f;
        }
        if let Some(s) = self.allow_spill {
            d.cards.allow_spill = s;
        }
        if let Some(r) = self.replicate_experts {
            d.cards.replicate_experts = r;
        }
        if let Some(m) = self.micro_batches {
            d.overlap.micro_batches = MicroBatchSetting(m);
        }
    }
}
