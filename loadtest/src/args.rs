//! The command-line flags of a workload and of its result files, as clap argument groups:
//! `afd-loadtest` and `afd emulate` both take them, so a workload written for one runs on the
//! other unchanged.

use std::path::PathBuf;

use clap::ValueEnum;

use crate::config::{BenchmarkConfig, PromptConfig, PromptSource, SloTarget};
use crate::output::OutputOptions;
use crate::sweep::Sweep;

/// Where prompts come from (`--prompt-source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PromptSourceArg {
    /// token ids for completions, random words for chat
    Auto,
    /// random token ids in [0, --vocab-size): exact prompt lengths (completions only)
    TokenIds,
    /// random common English words (about one token each)
    Words,
    /// the lines of --prompt-file
    File,
}

/// What is sent, when, and how much at once.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    /// Requests in the measured run.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Prompt length in tokens (words for text prompts).
    #[arg(long, default_value_t = 1024)]
    pub input_len: usize,
    /// Tokens (words for text) of one prefix shared by every prompt, before its own
    /// --input-len: a long system prompt, what prefix caching serves from cache.
    #[arg(long, alias = "random-prefix-len", default_value_t = 0)]
    pub prefix_len: usize,
    /// Output length in tokens (max_tokens); add --ignore-eos to get exactly this many.
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Draw each length uniformly from [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Where prompts come from.
    #[arg(long, value_enum, default_value = "auto")]
    pub prompt_source: PromptSourceArg,
    /// A text file with one prompt per line (implies --prompt-source file; vLLM's
    /// --dataset-path).
    #[arg(long, alias = "dataset-path")]
    pub prompt_file: Option<PathBuf>,
    /// Token ids are drawn from [0, vocab-size); keep it below the model's vocabulary.
    #[arg(long, default_value_t = 1000)]
    pub vocab_size: u32,
    /// Send ignore_eos: true so every request generates exactly --output-len tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Mean arrivals per second (Poisson; see --burstiness); inf sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 smoother.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Run one benchmark per value: concurrency=1,2,4,8 or rate=1,2,4,inf.
    #[arg(long)]
    pub sweep: Option<Sweep>,
    /// Goodput SLOs in ms, e.g. --goodput ttft:200 tpot:50 (keys: ttft, tpot, e2el).
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<SloTarget>,
    /// Percentiles to report besides the median, comma-separated.
    #[arg(long, default_value = "90,99", value_delimiter = ',')]
    pub metric_percentiles: Vec<f64>,
    /// Seed of prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl WorkloadArgs {
    /// The prompt source the flags name.
    pub fn prompt_source(&self) -> Result<PromptSource, String> {
        Ok(match (self.prompt_source, &self.prompt_file) {
            (PromptSourceArg::File | PromptSourceArg::Auto, Some(path)) => {
                PromptSource::File(path.clone())
            }
            (PromptSourceArg::File, None) => {
                return Err("--prompt-source file needs --prompt-file PATH".into());
            }
            (_, Some(_)) => {
                return Err(
                    "--prompt-file goes with --prompt-source file (or leave it auto)".into(),
                );
            }
            (PromptSourceArg::Auto, None) => PromptSource::Auto,
            (PromptSourceArg::TokenIds, None) => PromptSource::TokenIds,
            (PromptSourceArg::Words, None) => PromptSource::RandomWords,
        })
    }

    /// Sets the workload's fields of `config` from the flags.
    pub fn apply(&self, config: &mut BenchmarkConfig) -> Result<(), String> {
        config.num_prompts = self.num_prompts;
        config.prompts = PromptConfig {
            source: self.prompt_source()?,
            input_len: self.input_len,
            prefix_len: self.prefix_len,
            output_len: self.output_len,
            range_ratio: self.range_ratio,
            vocab_size: self.vocab_size,
        };
        config.ignore_eos = self.ignore_eos;
        config.temperature = self.temperature;
        config.request_rate = self.request_rate;
        config.burstiness = self.burstiness;
        config.max_concurrency = self.max_concurrency;
        config.goodput = self.goodput.clone();
        config.percentiles = self.metric_percentiles.clone();
        config.seed = self.seed;
        Ok(())
    }
}

/// Where the result goes.
#[derive(Debug, Clone, clap::Args)]
pub struct OutputArgs {
    /// Label written to the result (default: the backend name, openai or openai-chat).
    #[arg(long)]
    pub label: Option<String>,
    /// Folder for the JSON results and plots.
    #[arg(long, default_value = "bench-results")]
    pub result_dir: PathBuf,
    /// File name of the JSON result of a single run (default: vLLM's naming scheme).
    #[arg(long)]
    pub result_filename: Option<String>,
    /// Write no files; print the table only.
    #[arg(long)]
    pub no_save: bool,
    /// Write the JSON but no plots.
    #[arg(long)]
    pub no_plots: bool,
    /// No progress bar (also vLLM's --disable-tqdm).
    #[arg(long, alias = "disable-tqdm")]
    pub no_progress: bool,
}

impl OutputArgs {
    /// The files to write.
    pub fn options(&self) -> OutputOptions {
        OutputOptions {
            result_dir: self.result_dir.clone(),
            result_filename: self.result_filename.clone(),
            plots: !self.no_plots,
        }
    }
}
