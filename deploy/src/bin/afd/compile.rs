//! `afd compile`: compile every card's share of a model for the Corsair card, prove each program
//! with the sanitizer, and print placement, SRAM use by region kind, what spills to LPDDR and
//! the modeled time per layer. Needs only config.json (weights are not read).

use std::path::PathBuf;

use anyhow::{Context, bail};
use corsair_ffn::assignment::{PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile, compile_deployment};
use corsair_ffn::format::FormatChoice;
use corsair_ffn::perf::StepTime;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::report::{CardSummary, summarize};
use model::ModelConfig;

/// Compile each card's share (experts, dense slices, LM-head rows) and report it.
#[derive(Debug, clap::Args)]
pub struct CompileArgs {
    /// Checkpoint folder (only its config.json is read).
    #[arg(long)]
    model: PathBuf,
    /// Number of cards.
    #[arg(long)]
    cards: usize,
    /// Weight format of experts and dense layers: as-stored, bf16, mxfp4 or mxint8.
    #[arg(long, default_value = "as-stored")]
    format: FormatChoice,
    /// Largest number of tokens per step (sizes every activation buffer).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Stream weights that do not fit in SRAM from LPDDR instead of failing (modeled cost).
    #[arg(long)]
    allow_spill: bool,
    /// Hardware profile (TOML); default: the embedded Corsair profile.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: CompileArgs) -> anyhow::Result<()> {
    if args.cards == 0 {
        bail!("--cards must be at least 1");
    }
    let config_path = args.model.join("config.json");
    let text = std::fs::read_to_string(&config_path).with_context(|| {
        format!(
            "reading {} (is --model a checkpoint folder?)",
            config_path.display()
        )
    })?;
    let config = ModelConfig::from_json(&text, &config_path)?;
    let stored = StoredFormats::from_config_json(&text, &config)?;
    let profile = match &args.profile {
        Some(p) => {
            let t = std::fs::read_to_string(p)
                .with_context(|| format!("reading the profile {}", p.display()))?;
            HardwareProfile::from_toml(&t).with_context(|| format!("in {}", p.display()))?
        }
        None => HardwareProfile::default(),
    };
    let options = CompileOptions {
        format: args.format,
        max_tokens: args.max_tokens,
        allow_spill: args.allow_spill,
        ..CompileOptions::default()
    };
    let placement = PlacementOptions {
        cards: args.cards,
        replicas: vec![],
    };
    let results: Vec<Result<CardSummary, String>> =
        compile_deployment(&config, &stored, &placement, &options, &profile)?
            .into_iter()
            .map(|r| r.map(|c| summarize(&c)).map_err(|e| e.to_string()))
            .collect();
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    if args.json {
        let cards: Vec<serde_json::Value> = results
            .iter()
            .enumerate()
            .map(|(card, r)| match r {
                Ok(s) => serde_json::to_value(s).unwrap_or_default(),
                Err(e) => serde_json::json!({ "card": card, "error": e }),
            })
            .collect();
        let out = serde_json::json!({
            "model": args.model,
            "family": config.family.to_string(),
            "cards": args.cards,
            "format": args.format.to_string(),
            "max_tokens": args.max_tokens,
            "allow_spill": args.allow_spill,
            "profile": profile.name,
            "assumed": profile.assumed,
            "fits": failures.is_empty(),
            "per_card": cards,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{} ({}, {} layers, hidden {}{}) on {} card(s), {} weights, up to {} tokens per step, profile `{}` ({} assumed settings)",
            args.model.display(),
            config.family,
            config.num_layers(),
            config.hidden_size,
            config.moe.map_or(String::new(), |m| format!(
                ", {} experts top-{}",
                m.num_experts, m.top_k
            )),
            args.cards,
            args.format,
            args.max_tokens,
            profile.name,
            profile.assumed.len()
        );
        for r in &results {
            match r {
                Ok(s) => {
                    println!("{s}");
                    for line in layer_groups(&s.batch_one, &s.batch_max) {
                        println!("    {line}");
                    }
                }
                Err(e) => println!("{e}"),
            }
        }
    }
    if !failures.is_empty() {
        let hint = match fewest_cards(&config, &stored, &options, &profile, args.cards) {
            Some(n) => format!(" This model fits on {n} cards at this format (--cards {n})."),
            None => String::new(),
        };
        bail!(
            "{} of {} cards failed to compile; the first: {}{hint}",
            failures.len(),
            args.cards,
            failures[0]
        );
    }
    Ok(())
}

/// The fewest cards above `cards` (up to 16 times as many) on which the largest share (card 0:
/// the most experts, columns and vocabulary rows) compiles.
fn fewest_cards(
    config: &ModelConfig,
    stored: &StoredFormats,
    options: &CompileOptions,
    profile: &HardwareProfile,
    cards: usize,
) -> Option<usize> {
    (cards + 1..=cards * 16).find(|&n| {
        plan_placement(
            config,
            &PlacementOptions {
                cards: n,
                replicas: vec![],
            },
        )
        .is_ok_and(|plan| compile(config, stored, &plan[0], options, profile).is_ok())
    })
}

/// Modeled time per layer, consecutive layers with the same times grouped.
fn layer_groups(one: &StepTime, max: &StepTime) -> Vec<String> {
    let us = |s: f64| format!("{:.2} us", s * 1e6);
    let mut out = Vec::new();
    let mut start = 0;
    for l in 1..=one.layers.len() {
        let same = l < one.layers.len()
            && (one.layers[l].seconds - one.layers[start].seconds).abs() < 1e-12
            && (max.layers[l].seconds - max.layers[start].seconds).abs() < 1e-12;
        if !same {
            let name = if l - 1 == start {
                format!("layer {start}")
            } else {
                format!("layers {start}-{}", l - 1)
            };
            out.push(format!(
                "{name}: {} at batch 1, {} at batch {} (LPDDR {} / {})",
                us(one.layers[start].seconds),
                us(max.layers[start].seconds),
                max.tokens,
                us(one.layers[start].lpddr_seconds),
                us(max.layers[start].lpddr_seconds)
            ));
            start = l;
        }
    }
    out
}
