//! What `--eplb` does on recorded traffic, on the cost model: the steps of two routing records
//! (`--record-routing FILE --record-window 1`) served one after the other, the second with
//! another skew, with the contiguous placement and with the placement `--eplb` keeps moving
//! (the same window, interval and decision as serving: [`planner::eplb`]). Per phase: the
//! balancedness of each interval's load under the placement serving it, and the cards' modeled
//! decode step (per MoE layer the slowest card, [`planner::balance::cards_step_seconds`]),
//! against the same step under perfectly even routing.
//!
//!     cargo run --release -p deploy --example eplb_replay -- DEPLOYMENT.toml --cards 4 \
//!         --record A.json --record B.json --window 32 --interval 32 --redundant 4 [--json OUT]

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use corsair_ffn::CardAssignment;
use corsair_ffn::compiler::compile;
use deploy::deployment::Deployment;
use emulate::record::RoutingCounts;
use planner::CardSet;
use planner::balance::{ExpertLoad, balancedness, card_loads, cards_step_seconds, holders_of};
use planner::eplb::{EplbSettings, LoadWindow, MoveDecision, decide_move};
use planner::replication::ReplicateExperts;

#[derive(Parser)]
struct Args {
    /// The deployment file (model shape, profiles, workload batch).
    deployment: PathBuf,
    /// Cards.
    #[arg(long)]
    cards: usize,
    /// Routing records with one step per window, served in this order (one phase each).
    #[arg(long = "record", required = true)]
    records: Vec<PathBuf>,
    /// --eplb-window (steps).
    #[arg(long, default_value_t = 32)]
    window: usize,
    /// --eplb-step-interval (steps).
    #[arg(long, default_value_t = 32)]
    interval: usize,
    /// --num-redundant-experts.
    #[arg(long, default_value_t = 0)]
    redundant: usize,
    /// Least gain in mean balancedness worth a move (default: serving's).
    #[arg(long)]
    min_gain: Option<f64>,
    /// Tokens of the modeled decode step (default: the deployment's workload batch).
    #[arg(long)]
    batch: Option<usize>,
    /// Write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One interval's load under each placement.
#[derive(Debug, Default, Clone, serde::Serialize)]
struct Interval {
    balancedness_static: f64,
    balancedness_eplb: f64,
    cards_step_ms_static: f64,
    cards_step_ms_eplb: f64,
    cards_step_ms_even: f64,
}

/// One record served: its intervals, and the means over those after the phase's first (the
/// first is served by what the previous phase left).
#[derive(Debug, Default, serde::Serialize)]
struct Phase {
    record: String,
    steps: usize,
    moves: usize,
    intervals: Vec<Interval>,
    first: Interval,
    settled: Interval,
}

fn mean(xs: &[Interval]) -> Interval {
    let n = xs.len().max(1) as f64;
    let sum = |f: fn(&Interval) -> f64| xs.iter().map(f).sum::<f64>() / n;
    Interval {
        balancedness_static: sum(|i| i.balancedness_static),
        balancedness_eplb: sum(|i| i.balancedness_eplb),
        cards_step_ms_static: sum(|i| i.cards_step_ms_static),
        cards_step_ms_eplb: sum(|i| i.cards_step_ms_eplb),
        cards_step_ms_even: sum(|i| i.cards_step_ms_even),
    }
}

fn mean_balancedness(load: &ExpertLoad, assignments: &[CardAssignment], experts: usize) -> f64 {
    let cards = assignments.len();
    let per_layer: Vec<f64> = load
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(layer, l)| {
            balancedness(&card_loads(
                l,
                &holders_of(assignments, layer, experts),
                cards,
            ))
        })
        .collect();
    per_layer.iter().sum::<f64>() / per_layer.len().max(1) as f64
}

/// The same tokens per layer spread evenly over the experts.
fn even(load: &ExpertLoad) -> ExpertLoad {
    ExpertLoad {
        layers: load
            .layers
            .iter()
            .map(|l| {
                let total: u64 = l.iter().sum();
                let n = l.len().max(1) as u64;
                (0..l.len() as u64)
                    .map(|e| total / n + u64::from(e < total % n))
                    .collect()
            })
            .collect(),
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.window == 0 || args.interval == 0 {
        bail!("--window and --interval must be at least 1 step");
    }
    let mut d = Deployment::load(&args.deployment)?;
    d.cards.count = args.cards;
    d.cards.replicate_experts = ReplicateExperts::Never;
    d.cards.replicas.clear();
    let (config, stored) = deploy::plan::model_shape(&d)?;
    let profiles = deploy::plan::load_profiles(&d)?;
    let target = deploy::plan::target(&d);
    let options = target.compile_options();
    let experts = config.moe.context("the model has no experts")?.num_experts;
    let contiguous = corsair_ffn::plan_placement(
        &config,
        &corsair_ffn::PlacementOptions {
            cards: args.cards,
            replicas: Vec::new(),
        },
    )?;
    // Each placement's compiled cards, by its shares.
    let mut sets: HashMap<String, CardSet> = HashMap::new();
    let set_of = |sets: &mut HashMap<String, CardSet>,
                  shares: &[CardAssignment]|
     -> anyhow::Result<String> {
        let key = serde_json::to_string(shares)?;
        if !sets.contains_key(&key) {
            let programs = shares
                .iter()
                .map(|s| compile(&config, &stored, s, &options, &profiles.card).map(|c| c.program))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| "a share does not compile (fewer --redundant, or more cards)")?;
            sets.insert(key.clone(), CardSet::new(programs));
        }
        Ok(key)
    };
    let tokens = args.batch.unwrap_or(target.workload.batch).max(1);
    let settings = EplbSettings {
        window: args.window,
        step_interval: args.interval as u64,
        num_redundant_experts: args.redundant,
        min_gain: args.min_gain.unwrap_or(EplbSettings::default().min_gain),
        ..EplbSettings::default()
    };
    let moe = config.moe_layers();
    let mut window = LoadWindow::new(&moe, experts, args.window);
    let mut serving = contiguous.clone();
    let static_key = set_of(&mut sets, &contiguous)?;
    let mut phases = Vec::new();
    for path in &args.records {
        let record = RoutingCounts::read(path)?;
        record.check_shape(config.num_layers(), experts, path)?;
        if record.window_steps != 1 {
            bail!(
                "{}: windows of {} steps; record with --record-window 1",
                path.display(),
                record.window_steps
            );
        }
        let mut phase = Phase {
            record: path.display().to_string(),
            steps: record.windows.len(),
            ..Phase::default()
        };
        for block in record.windows.chunks(args.interval) {
            let mut load = ExpertLoad {
                layers: moe
                    .iter()
                    .map(|&m| if m { vec![0; experts] } else { Vec::new() })
                    .collect(),
            };
            for step in block {
                let mut counts = vec![0u32; moe.len() * experts];
                for (layer, per_expert) in step.counts.iter().enumerate() {
                    for (e, &n) in per_expert.iter().enumerate() {
                        load.layers[layer][e] += n;
                        counts[layer * experts + e] = n as u32;
                    }
                }
                window.observe_counts(counts);
            }
            let eplb_key = set_of(&mut sets, &serving)?;
            let ms =
                |key: &str, load: &ExpertLoad| cards_step_seconds(&sets[key], load, tokens) * 1e3;
            phase.intervals.push(Interval {
                balancedness_static: mean_balancedness(&load, &contiguous, experts),
                balancedness_eplb: mean_balancedness(&load, &serving, experts),
                cards_step_ms_static: ms(&static_key, &load),
                cards_step_ms_eplb: ms(&eplb_key, &load),
                cards_step_ms_even: ms(&static_key, &even(&load)),
            });
            // The look that ends the interval: the next one is served by what it decides.
            if block.len() == args.interval
                && let MoveDecision::Move(placed) =
                    decide_move(&config, &window.load(), &serving, &settings)?
            {
                serving = placed.assignments(&serving);
                phase.moves += 1;
            }
        }
        phase.first = phase.intervals.first().cloned().unwrap_or_default();
        phase.settled = mean(phase.intervals.get(1..).unwrap_or(&[]));
        for (what, i) in [
            ("first interval", &phase.first),
            ("after it", &phase.settled),
        ] {
            println!(
                "{} ({} steps, {} moves), {what}: balancedness {:.3} contiguous, {:.3} --eplb; \
                 cards' step {:.4} ms contiguous, {:.4} ms --eplb, {:.4} ms even routing \
                 (--eplb {:+.1}% over even)",
                phase.record,
                phase.steps,
                phase.moves,
                i.balancedness_static,
                i.balancedness_eplb,
                i.cards_step_ms_static,
                i.cards_step_ms_eplb,
                i.cards_step_ms_even,
                (i.cards_step_ms_eplb / i.cards_step_ms_even - 1.0) * 100.0
            );
        }
        phases.push(phase);
    }
    if let Some(out) = &args.json {
        let json = serde_json::json!({
            "deployment": args.deployment.display().to_string(),
            "cards": args.cards,
            "window": args.window,
            "interval": args.interval,
            "num_redundant_experts": args.redundant,
            "tokens": tokens,
            "phases": phases,
        });
        std::fs::write(out, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
