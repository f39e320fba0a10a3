//! Emulated deployments: load tests of a deployment on a modeled clock, so TPOT, TTFT and
//! throughput answer for the hardware the deployment names, not for the CPU that simulates it.
//!
//! Owns the run of an emulation (`afd emulate`): afd-loadtest's workload (the same requests at
//! the same arrival times for the same seed) sent through the router's own schedulers
//! ([`sim`]), each step timed by the planner's step model on the step's real batch and on the
//! routing its tokens took ([`cost`]); the routing comes from the model itself (a real node
//! run on the prompts) or from a generator ([`routing`]: uniform, Zipf-skewed, or replayed
//! from a recorded run, [`record`]); a card can fail on the reliability path's timeline
//! ([`faults`]). The result is afd-loadtest's result file, marked as modeled, with the step
//! breakdown added ([`report`]); [`trace`] draws a few steps as a Perfetto timeline. It also
//! times the steps of `afd serve --clock modeled` ([`ModeledTimer`]).
//!
//! Must not: sleep, read the wall clock for a figure, or re-implement the scheduler, the
//! dispatch or the metrics: it drives the router's [`router::Scheduler`], gpu-attention's
//! dispatch planner and afd-loadtest's metrics, so an emulation shows what afd itself does.

pub mod cost;
pub mod error;
pub mod faults;
pub mod node;
pub mod record;
pub mod report;
pub mod routing;
pub mod sim;
pub mod trace;

pub use cost::{ModeledStep, ModeledTimer, StepModel};
pub use error::{Error, Result};
pub use faults::CardFault;
pub use node::SyntheticNode;
pub use record::{RoutingCounts, RoutingRecorder};
pub use routing::{RoutingGenerator, RoutingSource};
pub use sim::{EmulatedRequest, SimOutcome, SimSettings, StepRecord};

use std::sync::Arc;

use loadtest::prompts::Prompt;
use loadtest::{BenchmarkConfig, BenchmarkResult, TimeBase};
use model::sampling::SamplingParams;
use router::{RouterConfig, SequenceParams};
use step::{AttentionNode, KvCapacity, Penalties, SampleRequest};

/// Text to token ids (a model's tokenizer).
pub type Tokenize = Box<dyn Fn(&str) -> Vec<u32> + Send + Sync>;
/// Token ids to text.
pub type Detokenize = Box<dyn Fn(&[u32]) -> String + Send + Sync>;

/// What an emulation runs on, besides its workload.
pub struct Emulation {
    /// The deployment's hardware and step model.
    pub model: Arc<StepModel>,
    /// The deployment in words (its file), for the result.
    pub deployment: String,
    /// The model's name in the result.
    pub model_name: String,
    /// The router's settings.
    pub router: RouterConfig,
    /// Attention nodes.
    pub nodes: usize,
    /// Each synthetic node's KV cache geometry.
    pub kv: KvCapacity,
    /// Where routing comes from.
    pub routing: RoutingSource,
    /// The model's end-of-sequence tokens (they end a request unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    /// Turns a text prompt into token ids (the model's tokenizer); `None`: a text prompt of
    /// `n` words becomes `n` tokens.
    pub tokenize: Option<Tokenize>,
    /// Turns generated token ids into text for the result; `None`: no text.
    pub detokenize: Option<Detokenize>,
    /// A card failure to inject.
    pub fault: Option<CardFault>,
}

/// One emulated run.
#[derive(Debug, Clone)]
pub struct EmulatedRun {
    /// afd-loadtest's result, with `time_base` and `emulation` filled.
    pub result: BenchmarkResult,
    /// What the run did, step by step.
    pub sim: SimOutcome,
}

impl Emulation {
    /// The requests of `bench`'s workload, as the router receives them.
    pub fn requests(&self, bench: &BenchmarkConfig) -> Result<Vec<EmulatedRequest>> {
        let (specs, offsets) = loadtest::workload(bench)?;
        let stop_token_ids = if bench.ignore_eos {
            Vec::new()
        } else {
            self.eos_token_ids.clone()
        };
        Ok(specs
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(i, (spec, &arrival))| {
                let prompt = match &spec.prompt {
                    Prompt::TokenIds(ids) => ids.clone(),
                    Prompt::Text(text) => match &self.tokenize {
                        Some(tokenize) => tokenize(text),
                        None => (0..spec.prompt_len as u32).collect(),
                    },
                };
                let params = SamplingParams {
                    temperature: bench.temperature.unwrap_or(0.0) as f32,
                    // Seeded per request, so sampled tokens repeat run after run.
                    seed: bench.seed.wrapping_add(i as u64),
                    ..SamplingParams::default()
                };
                EmulatedRequest {
                    prompt_len: prompt.len(),
                    prompt: if prompt.is_empty() { vec![0] } else { prompt },
                    params: SequenceParams {
                        max_tokens: spec.output_len.max(1),
                        sample: SampleRequest {
                            params,
                            penalties: Penalties::default(),
                            logprobs: false,
                            top_logprobs: 0,
                            allowed: None,
                        },
                        stop_token_ids: stop_token_ids.clone(),
                        constraint: None,
                        prompt_logprobs: None,
                    },
                    arrival,
                }
            })
            .collect())
    }

    /// Synthetic nodes, one per attention node, routing with a generator seeded by `seed`.
    pub fn synthetic_nodes(&self, seed: u64) -> Result<Vec<Box<dyn AttentionNode>>> {
        let config = self.model.config();
        let moe = config.moe_layers();
        // A token that ends no sequence: the first that is not an end-of-sequence token.
        let token = (0u32..)
            .find(|t| !self.eos_token_ids.contains(t))
            .unwrap_or(0);
        (0..self.nodes)
            .map(|n| {
                let generator = match config.moe {
                    Some(m) if self.cards_hold_experts() => Some(RoutingGenerator::new(
                        &self.routing,
                        &moe,
                        m.num_experts,
                        m.top_k,
                        seed.wrapping_add(n as u64),
                    )?),
                    _ => None,
                };
                Ok(Box::new(SyntheticNode::new(self.kv, generator, token))
                    as Box<dyn AttentionNode>)
            })
            .collect()
    }

    fn cards_hold_experts(&self) -> bool {
        self.model.cards().is_some()
    }

    /// Runs `bench`'s workload through `nodes` (synthetic ones, or real nodes for
    /// [`RoutingSource::Model`]), counting the routing in windows of `record_window` steps
    /// when given, calling `progress` as requests finish.
    pub fn run(
        &self,
        bench: &BenchmarkConfig,
        nodes: Vec<Box<dyn AttentionNode>>,
        record_window: Option<u64>,
        progress: impl FnMut(usize),
    ) -> Result<EmulatedRun> {
        let requests = self.requests(bench)?;
        let settings = SimSettings {
            router: self.router.clone(),
            max_concurrency: bench.max_concurrency,
            fault: self.fault.clone(),
            record_window,
        };
        let mut sim = sim::run(nodes, &self.model, &requests, &settings, progress)?;
        if let Some(detokenize) = &self.detokenize {
            for (o, ids) in sim.outcomes.iter_mut().zip(&sim.token_ids) {
                o.generated_text = detokenize(ids);
            }
        }
        let mut result = loadtest::benchmark_result(
            bench,
            &self.model_name,
            format!("afd-emulate:{}", self.deployment),
            &sim.outcomes,
            sim.duration,
            loadtest::result::utc_timestamp(),
        );
        result.time_base = Some(TimeBase {
            clock: "modeled".into(),
            dilation: 1.0,
            note: format!(
                "modeled: afd emulate ran {} on the hardware it names ({}, {}, {}); no time \
                 here was measured on this machine",
                self.deployment,
                self.model.profiles().device.name,
                self.model.profiles().card.name,
                self.model.profiles().network.name
            ),
        });
        result.emulation = Some(report::summary(self, &sim));
        Ok(EmulatedRun { result, sim })
    }
}

#[cfg(test)]
mod tests;
