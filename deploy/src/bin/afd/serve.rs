//! `afd serve`: the whole system in one process: the OpenAI-compatible HTTP server, the router,
//! M attention nodes and N simulated cards talking JetStream over loopback QUIC.
//!
//! Without flags it serves the small GPT-OSS-architecture model that ships in the repository
//! (`models/afd-tiny-gpt-oss`) on 2 cards at 127.0.0.1:8000.
//!
//! With `--attention-addrs` it is the frontend alone (HTTP server and router) over running
//! `afd attention` processes, the shape `afd up` and Kubernetes deployments use.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use corsair_ffn::service::CardHost;
use deploy::cluster::{ClusterConfig, EmbeddedCluster, StartEvent};
use deploy::shutdown::StopSignals;
use indicatif::{ProgressBar, ProgressStyle};
use router::{AfdStats, AfdStatsSource, Dilation, Router, RouterConfig, SchedulerConfig};
use server::tool_parsing::{ReasoningParserKind, ToolCallParserKind};
use server::{Server, ServerConfig};
use step::AttentionNode;

use crate::cluster_args::ClusterArgs;
use crate::serve_clock::timing;
use crate::serve_routing::record_routing;

/// Where the bundled model lives, relative to the repository root.
const BUNDLED_MODEL: &str = "models/afd-tiny-gpt-oss";

/// Serve the OpenAI-compatible API (completions, chat, models, tokenize, metrics) with
/// continuous batching over M attention nodes sharing N cards.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Checkpoint folder (Hugging Face layout); default: the bundled model,
    /// models/afd-tiny-gpt-oss.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Attention nodes sharing the cards; each new request goes to the least-loaded one.
    #[arg(long, default_value_t = 1)]
    pub(crate) attention_nodes: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8000)]
    pub(crate) port: u16,
    /// Most sequences in one step, per attention node (vLLM's max_num_seqs).
    #[arg(long, default_value_t = 256)]
    pub(crate) max_num_seqs: usize,
    /// Longest sequence, prompt plus output (vLLM's max_model_len); default: the model's
    /// max_position_embeddings, capped by the KV cache of one attention node.
    #[arg(long)]
    pub(crate) max_model_len: Option<usize>,
    /// Requests allowed to wait for a slot; beyond it the server answers 429.
    #[arg(long, default_value_t = 1024)]
    pub(crate) max_waiting: usize,
    /// Reuse the KV blocks of prompt prefixes computed before (vLLM's automatic prefix
    /// caching, on by default; --no-enable-prefix-caching turns it off). Outputs are the same
    /// either way; the reference forward (--reference on the CPU) keeps no blocks to share.
    #[arg(
        long = "enable-prefix-caching",
        overrides_with = "no_enable_prefix_caching"
    )]
    pub(crate) enable_prefix_caching: bool,
    /// Turn automatic prefix caching off.
    #[arg(
        long = "no-enable-prefix-caching",
        overrides_with = "enable_prefix_caching"
    )]
    pub(crate) no_enable_prefix_caching: bool,
    /// Model id in /v1/models and responses; default: the --model path as given.
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Serve the monolithic reference forward (whole model in this process, no cards) instead of
    /// the disaggregated path; for comparisons. With --device cuda: the whole model on the GPU
    /// (the GPU-only baseline).
    #[arg(long)]
    pub(crate) reference: bool,
    /// Frontend only: step through running `afd attention` processes at these addresses
    /// (host:port, comma-separated) instead of starting cards and attention nodes here. The
    /// cluster flags then do not apply, except --max-num-batched-tokens, which must match the
    /// nodes'.
    #[arg(long, value_delimiter = ',', conflicts_with = "reference")]
    pub(crate) attention_addrs: Vec<String>,
    /// Frontend only: the folder of `afd certs` with the cluster CA and the `frontend`
    /// certificate and key: the attention nodes' control plane is mutual TLS and answers only
    /// the frontend's certificate.
    #[arg(long, requires = "attention_addrs")]
    pub(crate) certs: Option<PathBuf>,
    /// Bearer token every /v1/* request must carry (`Authorization: Bearer ...`); default: no
    /// authentication. Prefer the environment variable: a command line is visible to anyone on
    /// the machine.
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    pub(crate) api_key: Option<String>,
    /// Seconds to keep retrying --attention-addrs while they are still starting.
    #[arg(long, default_value_t = 300.0)]
    pub(crate) connect_timeout: f64,
    /// Seconds requests in flight may take to finish after SIGTERM or SIGINT (the server
    /// answers new ones 503 meanwhile); what still runs then ends with an error. A second
    /// signal ends it at once. Deployment-file key: `server.shutdown_timeout`.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) shutdown_timeout: f64,
    /// What serving's times are: wall (the host's own speed) or modeled (each step takes
    /// what the deployment's hardware would take, per the planner's step model and the
    /// routing the step made, stretched --time-dilation times; docs/EMULATION.md).
    #[arg(long, default_value = "wall")]
    pub(crate) clock: ClockKind,
    /// With --clock modeled: wall seconds per modeled second (at least 1), or auto to measure
    /// it from the first steps. Responses carry it (x-afd-time-dilation), /metrics too.
    #[arg(long, default_value = "auto")]
    pub(crate) time_dilation: Dilation,
    /// With --clock modeled: the attention device the steps are modeled on (h100, h200 or a
    /// profile file; deployment-file key `attention.profile`).
    #[arg(long, default_value = "h100")]
    pub(crate) attention_profile: String,
    /// Count every step's routing (per layer and expert, per window of steps) into FILE, for
    /// `afd emulate --routing trace:FILE` (docs/EMULATION.md); written every 30 s and when the
    /// server stops.
    #[arg(long)]
    pub(crate) record_routing: Option<PathBuf>,
    /// Steps per window of --record-routing.
    #[arg(long, default_value_t = 256)]
    pub(crate) record_window: u64,
    /// Parse the model's tool calls into `tool_calls` when a chat request's `tool_choice` is
    /// "auto" (the default when it sends `tools`), as vLLM's flag; without it such requests
    /// are refused (400) and `tool_choice: "none"` returns the output as text.
    #[arg(long)]
    pub(crate) enable_auto_tool_choice: bool,
    /// How the model writes tool calls: openai (GPT-OSS harmony), hermes (Qwen3's
    /// `<tool_call>`) or mistral (`[TOOL_CALLS]`); default: by config.json's model_type
    /// (gpt_oss: openai, qwen3_moe: hermes, mixtral: mistral).
    #[arg(long, value_parser = parse_tool_call_parser)]
    pub(crate) tool_call_parser: Option<ToolCallParserKind>,
    /// How the model writes its reasoning, which goes to `reasoning_content`: openai_gptoss
    /// (harmony's analysis channel), qwen3 (`<think>`) or none (reasoning stays in
    /// `content`); default: by config.json's model_type (gpt_oss: openai_gptoss, qwen3_moe:
    /// qwen3, mixtral: none).
    #[arg(long, value_parser = parse_reasoning_parser)]
    pub(crate) reasoning_parser: Option<ReasoningParserKind>,
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
}

fn parse_tool_call_parser(s: &str) -> Result<ToolCallParserKind, String> {
    s.parse()
        .map_err(|e: server::tool_parsing::UnknownParser| e.to_string())
}

fn parse_reasoning_parser(s: &str) -> Result<ReasoningParserKind, String> {
    s.parse()
        .map_err(|e: server::tool_parsing::UnknownParser| e.to_string())
}

/// `--clock`: the wall's, or modeled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClockKind {
    /// The host's own speed.
    Wall,
    /// The deployment's modeled hardware, dilated.
    Modeled,
}

/// The bundled model: `models/afd-tiny-gpt-oss` under the current directory, else under the
/// repository this binary was built from.
fn bundled_model() -> PathBuf {
    let here = PathBuf::from(BUNDLED_MODEL);
    if here.exists() {
        return here;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(BUNDLED_MODEL);
    match repo.canonicalize() {
        Ok(path) => path,
        Err(_) => here,
    }
}

/// What keeps a deployment alive while it serves (the cards and their endpoints' runtimes).
/// Owned by `run` alone and dropped on its thread once the HTTP runtime and the router's
/// engines are gone: dropping it joins the cards' threads, which must not block an async task.
pub enum Deployment {
    /// Cards in this process.
    Embedded(EmbeddedCluster),
    /// The reference model; nothing to keep.
    Reference,
    /// Attention nodes in other processes, reached over gRPC driven by this runtime.
    Remote {
        /// Kept alive while the nodes' channels are in use.
        _runtime: tokio::runtime::Runtime,
    },
}

/// Connects to running attention processes (frontend-only mode).
fn remote_nodes(
    addresses: &[String],
    certs: Option<&std::path::Path>,
    patience: std::time::Duration,
) -> anyhow::Result<(Deployment, Vec<Box<dyn AttentionNode>>)> {
    let certs = certs.context(
        "the frontend needs --certs DIR (made by `afd certs --nodes frontend,...`): the attention \
         nodes' control plane is mutual TLS",
    )?;
    let identity = jetstream::NodeIdentity::read_pem(certs, deploy::cluster::FRONTEND_NAME)
        .with_context(|| {
            format!(
                "reading the frontend's certificate from {}",
                certs.display()
            )
        })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("afd-step-client")
        .enable_all()
        .build()
        .context("starting the gRPC client runtime")?;
    let nodes = deploy::remote::connect_attention_nodes(addresses, &identity, patience, &runtime)
        .context("connecting to the attention nodes")?
        .into_iter()
        .map(|node| Box::new(node) as Box<dyn AttentionNode>)
        .collect();
    Ok((Deployment::Remote { _runtime: runtime }, nodes))
}

/// Builds the attention nodes of a deployment: the one place that decides what a node is
/// (disaggregated over the cards, or the monolithic reference).
pub fn build_nodes(
    config: &ClusterConfig,
    reference: bool,
    progress: &mut dyn FnMut(StartEvent),
) -> anyhow::Result<(Deployment, Vec<Box<dyn AttentionNode>>)> {
    if reference {
        let mut nodes: Vec<Box<dyn AttentionNode>> = Vec::new();
        for j in 0..config.attention_nodes {
            progress(StartEvent::ConnectingNode(j, config.attention_nodes));
            let weights = config
                .load_weights(model::weights::ExpertFilter::All)
                .with_context(|| format!("loading {}", config.model.display()))?;
            let device = config.node.device;
            crate::cluster_args::check_device_numerics(device, config.activation_dtype)?;
            if device.is_host() {
                let capacity = config.node.kv.capacity(&weights.config);
                let model = model::ReferenceModel::new(weights)?;
                nodes.push(Box::new(gpu_attention::monolithic::MonolithicNode::new(
                    model, capacity,
                )));
            } else {
                // The GPU-only baseline: the whole model on the device.
                let node = gpu_attention::device::DeviceMonolithicNode::new(
                    &weights,
                    &config.node.kv,
                    device,
                )
                .with_context(|| format!("the whole model on {device}"))?;
                nodes.push(Box::new(node));
            }
        }
        return Ok((Deployment::Reference, nodes));
    }
    let mut cluster = EmbeddedCluster::start(config, progress).with_context(|| {
        format!(
            "starting {} card(s) and {} attention node(s) for {}",
            config.cards,
            config.attention_nodes,
            config.model.display()
        )
    })?;
    let nodes = match config.eplb {
        Some(settings) => {
            let targets = cluster.move_targets();
            deploy::eplb::start(settings, targets, cluster.take_nodes())
                .context("starting --eplb")?
                .nodes
        }
        None => cluster
            .take_nodes()
            .into_iter()
            .map(|node| Box::new(node) as Box<dyn AttentionNode>)
            .collect(),
    };
    Ok((Deployment::Embedded(cluster), nodes))
}

/// The disaggregated path's figures for `/metrics`: the cards alone, never the cluster, so the
/// server's tasks cannot end up owning (and dropping) the cluster's runtime.
struct ClusterStats {
    cards: Vec<Arc<CardHost>>,
}

impl AfdStatsSource for ClusterStats {
    fn snapshot(&self) -> AfdStats {
        let cards: Vec<_> = self.cards.iter().map(|c| c.stats()).collect();
        let layers = cards
            .iter()
            .map(|c| c.expert_tokens.len())
            .max()
            .unwrap_or(0);
        AfdStats {
            card_modeled_seconds: cards.iter().map(|c| c.modeled_seconds).collect(),
            jetstream_bytes_per_card: cards.iter().map(|c| c.bytes_in + c.bytes_out).collect(),
            // Not measured per layer yet: the attention node's fabric counts totals only.
            jetstream_bytes_per_layer: Vec::new(),
            expert_tokens_per_card: cards.iter().map(|c| c.expert_tokens.iter().sum()).collect(),
            expert_tokens_per_layer_card: (0..layers)
                .map(|layer| {
                    cards
                        .iter()
                        .map(|c| c.expert_tokens.get(layer).copied().unwrap_or(0))
                        .collect()
                })
                .collect(),
        }
    }
}

fn progress_bar(config: &ClusterConfig, reference: bool) -> ProgressBar {
    let steps = if reference {
        config.attention_nodes
    } else {
        config.cards + config.attention_nodes
    };
    let bar = ProgressBar::new(steps as u64);
    let style = ProgressStyle::with_template("{spinner} [{elapsed}] {bar:30} {pos}/{len} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

impl ServeArgs {
    /// Compute threads for this process's attention side (0: every core).
    pub fn compute_threads(&self) -> usize {
        if self.reference || !self.attention_addrs.is_empty() {
            0
        } else {
            self.cluster.compute_threads()
        }
    }
}

/// `afd frontend`: the frontend role alone.
pub fn run_frontend(args: ServeArgs) -> anyhow::Result<()> {
    if args.attention_addrs.is_empty() {
        anyhow::bail!(
            "afd frontend needs --attention-addrs HOST:PORT,... (the running afd attention \
             processes to step through); to run every role in one process, use afd serve"
        );
    }
    run(args)
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let model_dir = checked_model_dir(&args)?;
    if args.attention_nodes == 0 {
        bail!("--attention-nodes must be at least 1");
    }
    let frontend_only = !args.attention_addrs.is_empty();
    let mut cluster = args.cluster.config(model_dir.clone());
    cluster.attention_nodes = if frontend_only {
        args.attention_addrs.len()
    } else {
        args.attention_nodes
    };
    if cluster.eplb.is_some() && (frontend_only || args.reference) {
        bail!(
            "--eplb moves experts between the cards of attention nodes in this process; {}",
            if args.reference {
                "--reference runs the whole model in the node, with no cards"
            } else {
                "with --attention-addrs the nodes are other processes: give --eplb to them"
            }
        );
    }
    let model_config = model::ModelConfig::from_file(&model_dir.join("config.json"))
        .with_context(|| format!("reading {}", model_dir.join("config.json").display()))?;

    let (deployment, nodes) = if frontend_only {
        remote_nodes(
            &args.attention_addrs,
            args.certs.as_deref(),
            std::time::Duration::from_secs_f64(args.connect_timeout.max(0.0)),
        )?
    } else {
        let bar = progress_bar(&cluster, args.reference);
        bar.set_message(format!("loading {}", model_dir.display()));
        let built = build_nodes(&cluster, args.reference, &mut |event| {
            match event {
                StartEvent::LoadingCard(i, n) => {
                    bar.set_message(format!("compiling and loading card {}/{n}", i + 1))
                }
                StartEvent::ConnectingNode(j, m) => {
                    bar.set_message(format!("connecting attention node {}/{m}", j + 1))
                }
            }
            bar.inc(1);
        })?;
        bar.finish_with_message("ready");
        built
    };

    if !frontend_only {
        for (j, n) in nodes.iter().enumerate() {
            let k = n.kv_capacity();
            eprintln!(
                "afd serve: attention node {j} on {}: KV cache of {} blocks of {} tokens ({} tokens)",
                cluster.node.device,
                k.num_blocks,
                k.block_size,
                k.num_blocks * k.block_size
            );
        }
    }
    let router_config = router_config(&args, &nodes, &model_config)?;
    let max_model_len = router_config.scheduler.max_model_len;
    let (nodes, recorder) = record_routing(&args, nodes, &model_config, &model_dir)?;
    let timing = timing(&args, &model_dir, &cluster, max_model_len, nodes.len())?;
    let router = Router::start_with(router_config, nodes, timing).context("starting the router")?;
    let afd_stats: Option<Arc<dyn AfdStatsSource>> = match &deployment {
        Deployment::Embedded(c) => Some(Arc::new(ClusterStats {
            cards: c.cards.clone(),
        })),
        Deployment::Reference | Deployment::Remote { .. } => None,
    };
    let server_config = server_config(&args, &model_dir);
    raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("afd-http")
        .build()
        .context("starting the HTTP runtime")?;
    let state = runtime.block_on(async move {
        let server = Server::bind(server_config, router, afd_stats).await?;
        let state = Arc::clone(server.state());
        let what = if args.reference && cluster.node.device.is_host() {
            "the reference forward".to_string()
        } else if args.reference {
            format!("the whole model on {}", cluster.node.device)
        } else if frontend_only {
            format!("attention node(s) at {}", args.attention_addrs.join(","))
        } else {
            format!("{} card(s) over {:?}", cluster.cards, cluster.transport)
        };
        let mut signals = StopSignals::install().context("catching SIGTERM and SIGINT")?;
        eprintln!(
            "afd serve: {} on {what}, {} attention node(s), max_model_len {max_model_len}; \
             listening on http://{}",
            model_dir.display(),
            cluster.attention_nodes,
            server.local_addr()
        );
        let lifecycle = Arc::clone(&state.lifecycle);
        let timeout = args.shutdown_timeout;
        let stop = async move {
            let first = signals.recv().await;
            eprintln!(
                "afd serve: {first}: draining, {} request(s) in flight, up to {timeout} s \
                 (a second signal ends them now)",
                lifecycle.in_flight()
            );
            tokio::spawn(async move {
                let second = signals.recv().await;
                eprintln!("afd serve: {second} again: ending what still runs");
                lifecycle.cut_off();
            });
        };
        let report = server.run_until(stop).await?;
        eprintln!(
            "afd serve: drained in {:.1} s; {} request(s) cut off at the end",
            report.took.as_secs_f64(),
            report.cut_off
        );
        anyhow::Ok(state)
    })?;
    // In this order, each on this thread: the engines (they hold the attention nodes, which
    // use the cluster's runtime), the HTTP runtime and the tasks it still holds, then the
    // cluster and its runtime.
    if !state.router.shutdown(ENGINE_PATIENCE) {
        eprintln!(
            "afd serve: an engine was still in a step after {ENGINE_PATIENCE:?}; exiting anyway"
        );
    }
    drop(state);
    drop(runtime);
    drop(deployment);
    if let Some(file) = recorder {
        file.finish()?;
    }
    Ok(())
}

/// `--model`, or the bundled model, checked to be a checkpoint folder.
fn checked_model_dir(args: &ServeArgs) -> anyhow::Result<PathBuf> {
    let model_dir = args.model.clone().unwrap_or_else(bundled_model);
    if !model_dir.join("config.json").exists() {
        if args.model.is_none() {
            bail!(
                "the bundled model is not in {} (yet); pass --model DIR with a Hugging Face \
                 checkpoint folder, for example one made by `afd synth --family gpt-oss --preset \
                 small --out /tmp/afd-small`",
                model_dir.display()
            );
        }
        bail!(
            "{} has no config.json: --model must be a Hugging Face checkpoint folder",
            model_dir.display()
        );
    }
    Ok(model_dir)
}

/// The scheduler's settings, `max_model_len` checked against the smallest node's KV cache.
fn router_config(
    args: &ServeArgs,
    nodes: &[Box<dyn AttentionNode>],
    model_config: &model::ModelConfig,
) -> anyhow::Result<RouterConfig> {
    let capacity = nodes
        .iter()
        .map(|n| {
            let k = n.kv_capacity();
            k.block_size * k.num_blocks
        })
        .min()
        .unwrap_or(0);
    let max_model_len = match args.max_model_len {
        Some(m) if m > capacity => bail!(
            "--max-model-len {m} exceeds the KV cache of an attention node ({capacity} tokens); \
             raise --kv-cache-memory or lower --max-model-len"
        ),
        Some(m) => m,
        None => model_config.max_position_embeddings.min(capacity),
    };
    let router_config = RouterConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.cluster.node.max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill: true,
            enable_prefix_caching: !args.no_enable_prefix_caching,
        },
        max_waiting: args.max_waiting,
    };
    Ok(router_config)
}

/// The HTTP server's settings from the command line.
fn server_config(args: &ServeArgs, model_dir: &Path) -> ServerConfig {
    ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_dir: model_dir.to_path_buf(),
        // The bundled model is served under its short name unless told otherwise.
        served_model_name: args.served_model_name.clone().or_else(|| {
            args.model.is_none().then(|| {
                BUNDLED_MODEL
                    .rsplit('/')
                    .next()
                    .unwrap_or(BUNDLED_MODEL)
                    .to_string()
            })
        }),
        api_key: args.api_key.clone().map(server::ApiKey::new),
        shutdown_timeout: std::time::Duration::from_secs_f64(args.shutdown_timeout.max(0.0)),
        enable_auto_tool_choice: args.enable_auto_tool_choice,
        tool_call_parser: args.tool_call_parser,
        reasoning_parser: args.reasoning_parser,
        ..ServerConfig::default()
    }
}

/// How long the engines may take to finish the step they are in once the server has drained.
const ENGINE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Raises this process's soft open-file limit to its hard limit (as vLLM does), so that the
/// connection bound the server derives from it is as high as the system allows.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write only the struct given, on this stack.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
