//! `afd serve --clock modeled`: each step timed by the planner's model of the deployment the
//! flags describe, instead of by the CPU that simulates it.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use deploy::cluster::ClusterConfig;
use router::{Dilation, Timing};

use crate::serve::{ClockKind, ServeArgs};

/// `--clock`: wall time, or each step timed by the planner's model of the deployment.
pub(crate) fn timing(
    args: &ServeArgs,
    model_dir: &Path,
    cluster: &ClusterConfig,
    max_model_len: usize,
    node_count: usize,
) -> anyhow::Result<Timing> {
    let frontend_only = !args.attention_addrs.is_empty();
    Ok(match args.clock {
        ClockKind::Wall => Timing::default(),
        ClockKind::Modeled => {
            if frontend_only {
                bail!(
                    "--clock modeled needs the attention nodes in this process (their routing \
                     times each step); it does not work with --attention-addrs"
                );
            }
            let model = modeled_steps(args, model_dir, cluster, max_model_len)?;
            let timers = (0..node_count)
                .map(|_| {
                    Box::new(emulate::ModeledTimer {
                        model: Arc::clone(&model),
                    }) as Box<dyn step::StepTimer>
                })
                .collect();
            eprintln!(
                "afd serve: modeled clock: steps timed on {} + {} x {} over {}, dilated {}",
                model.profiles().device.name,
                cluster.cards,
                model.profiles().card.name,
                model.profiles().network.name,
                match args.time_dilation {
                    Dilation::Fixed(k) => format!("{k} times"),
                    Dilation::Auto => "by a factor measured on the first steps".into(),
                }
            );
            Timing::modeled(timers, args.time_dilation)
        }
    })
}

/// The step model of what `afd serve` runs, on the modeled hardware: the planner's target made
/// of the serving flags, with the attention device of `--attention-profile`, Corsair cards and
/// JetStream.
fn modeled_steps(
    args: &ServeArgs,
    model_dir: &Path,
    cluster: &ClusterConfig,
    max_model_len: usize,
) -> anyhow::Result<Arc<emulate::StepModel>> {
    let path = model_dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config = model::ModelConfig::from_json(&text, &path)?;
    let stored = corsair_ffn::compiler::StoredFormats::from_config_json(&text, &config)
        .with_context(|| format!("reading the weight formats of {}", path.display()))?;
    let node = &args.cluster.node;
    let target = planner::Target {
        source: "afd serve".into(),
        model_name: model_dir.display().to_string(),
        attention: planner::AttentionTarget {
            nodes: cluster.attention_nodes,
            max_num_seqs: args.max_num_seqs,
            max_model_len,
            kv_cache_memory_mib: None,
            max_num_batched_tokens: node.max_num_batched_tokens,
            wire_bytes: node.wire_dtype.size(),
        },
        cards: planner::CardsTarget {
            count: if args.reference { 0 } else { cluster.cards },
            format: node.format,
            allow_spill: node.allow_spill,
            replicas: Vec::new(),
            replicate_experts: node.replicate_experts,
            groups: node.card_groups,
        },
        micro_batches: node.micro_batches,
        workload: planner::PlannedWorkload {
            batch: 1,
            input_len: 1,
            output_len: 0,
        },
    };
    let profiles = planner::Profiles {
        device: planner::load_profile(
            &args.attention_profile,
            "--attention-profile",
            planner::DeviceProfile::builtin,
            planner::DeviceProfile::from_toml,
        )?,
        card: corsair_ffn::HardwareProfile::default(),
        network: planner::NetworkProfile::builtin("jetstream")
            .context("the built-in JetStream profile is missing")??,
    };
    Ok(Arc::new(emulate::StepModel::new(
        &target, config, &stored, profiles,
    )?))
}
