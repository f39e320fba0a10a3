//! The planner's tables for docs/PLANNING.md: the seed table, the calibration fit, and
//! predictions for GPT-OSS-20B over card counts, batch sizes and a 64K context; draws
//! docs/plots/tpot_vs_cards.svg.
//!
//! `cargo run --release -p deploy --example plan_sweep [-- --plot docs/plots/tpot_vs_cards.svg]`

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use corsair_ffn::compiler::StoredFormats;
use deploy::deployment::{Deployment, MicroBatchSetting};
use deploy::plan::seed::{SEED_ROWS, apply, calibrate};
use deploy::plan::{Plan, load_profiles, plan};
use gpu_attention::MicroBatches;
use model::ModelConfig;
use planner::ReplicateExperts;
use plotters::prelude::*;

const DARK_GREEN: RGBColor = RGBColor(0, 140, 60);

fn deployments() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deployments")
}

struct Planner {
    config: ModelConfig,
    stored: StoredFormats,
}

impl Planner {
    fn new(d: &Deployment) -> Result<Self> {
        let (text, path) = d.model_config_text()?;
        let config = ModelConfig::from_json(&text, &path)?;
        let stored = StoredFormats::from_config_json(&text, &config)?;
        Ok(Planner { config, stored })
    }

    fn plan(&self, d: &Deployment) -> Result<Plan> {
        Ok(plan(d, &self.config, &self.stored, &load_profiles(d)?)?)
    }
}

/// The shipped deployment `name`, with one copy of each expert: the sweeps compare card
/// counts and batches as the seed articles' setups had them, not `replicate_experts = "auto"`,
/// which adds copies wherever they fit (12 and 16 cards for GPT-OSS-20B).
fn load(name: &str) -> Result<Deployment> {
    let mut d = Deployment::load(&deployments().join(name)).with_context(|| name.to_string())?;
    d.cards.replicate_experts = ReplicateExperts::Never;
    Ok(d)
}

fn seed_table(planner: &Planner) -> Result<()> {
    println!("| seed setup | seed figure | afd plan | error | role |");
    println!("|---|---|---|---|---|");
    for row in &SEED_ROWS {
        let mut d = load(row.file)?;
        apply(row, &mut d);
        let p = planner.plan(&d)?;
        let got = row.metric.of(&p).context("no prediction")?;
        let role = match row.calibrates {
            Some(c) => format!("calibrates `{c}`"),
            None => "prediction".into(),
        };
        println!(
            "| {} | {} | {:.4} | {:+.1}% | {role} |",
            row.setup,
            row.figure,
            got,
            100.0 * (got - row.figure) / row.figure
        );
    }
    let afd = load(SEED_ROWS[1].file)?;
    let alone = load(SEED_ROWS[0].file)?;
    let fit = calibrate(
        &afd,
        &alone,
        &planner.config,
        &planner.stored,
        &load_profiles(&afd)?,
    )?;
    println!(
        "\nfitted: kernels.fixed_ns = {:.1}, kernels.mxfp4_moe_bandwidth_efficiency = {:.4}",
        fit.fixed_ns, fit.mxfp4_moe_bandwidth_efficiency
    );
    Ok(())
}

/// TPOT of `file` (with a workload override) for each card count, spilling where the experts
/// do not fit.
fn card_sweep(
    planner: &Planner,
    file: &str,
    workload: Option<(usize, usize)>,
    counts: &[usize],
) -> Result<Vec<(usize, f64, String)>> {
    println!("\n{file} {workload:?}:");
    println!(
        "| cards | TPOT ms | tok/s per user | output tok/s | SRAM per card | spilled per card | bound |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut out = Vec::new();
    for &cards in counts {
        let mut d = load(file)?;
        if let Some((i, o)) = workload {
            d.workload.input_len = i;
            d.workload.output_len = o;
        }
        d.cards.count = cards;
        d.cards.allow_spill = true;
        let p = planner.plan(&d)?;
        let Some(pred) = &p.predicted else {
            println!(
                "| {cards} | does not fit: {} | | | | |",
                p.problems.join("; ")
            );
            continue;
        };
        let (need, spill) = p
            .per_card
            .first()
            .map_or((0, 0), |c| (c.sram_bytes_needed, c.spilled_bytes));
        let bound = if cards == 0 {
            "GPU alone".to_string()
        } else {
            pred.breakdown.bound.clone()
        };
        println!(
            "| {cards} | {:.3} | {:.0} | {:.0} | {:.2} GB | {:.2} GB | {bound} |",
            pred.tpot_ms,
            pred.per_user_tokens_per_s,
            pred.output_tokens_per_s,
            need as f64 / 1e9,
            spill as f64 / 1e9
        );
        out.push((cards, pred.tpot_ms, bound));
    }
    Ok(out)
}

fn batch_sweep(planner: &Planner) -> Result<()> {
    println!(
        "\n| batch | H100s | step ms, 1 micro-batch | step ms, 2 micro-batches | TPOT ms (1K/1K) | output tok/s (1K/1K) | bound |"
    );
    println!("|---|---|---|---|---|---|---|");
    for nodes in [1usize, 2] {
        for batch in [1usize, 2, 4, 8, 16, 32, 64] {
            if batch < nodes {
                continue;
            }
            let mut d = load("gpt-oss-20b-2xh100-8cards-batch64.toml")?;
            d.attention.nodes = nodes;
            d.attention.max_num_seqs = 64;
            d.workload.batch = batch;
            d.workload.input_len = 1024;
            d.workload.output_len = 0;
            let mut steps = Vec::new();
            for m in [MicroBatches::One, MicroBatches::Two] {
                d.overlap.micro_batches = MicroBatchSetting(m);
                let p = planner.plan(&d)?;
                steps.push(p.predicted.context("no prediction")?);
            }
            // The 1K/1K run with whichever split is faster at this batch.
            let best = if steps[0].step_ms <= steps[1].step_ms {
                MicroBatches::One
            } else {
                MicroBatches::Two
            };
            d.overlap.micro_batches = MicroBatchSetting(best);
            d.workload.output_len = 1024;
            let run = planner.plan(&d)?.predicted.context("no prediction")?;
            let fastest = &steps[usize::from(best == MicroBatches::Two)];
            println!(
                "| {batch} | {nodes} | {:.3} | {:.3} | {:.3} | {:.0} | {} |",
                steps[0].step_ms,
                steps[1].step_ms,
                run.tpot_ms,
                run.output_tokens_per_s,
                fastest.breakdown.bound
            );
        }
    }
    Ok(())
}

fn long_context(planner: &Planner) -> Result<()> {
    println!("\n| context | cards | TPOT ms | KV on the device | bound |");
    println!("|---|---|---|---|---|");
    for (ctx, cards) in [
        (1024usize, 16usize),
        (16384, 16),
        (65536, 16),
        (65536, 8),
        (65536, 0),
    ] {
        let mut d = load("gpt-oss-20b-64k-16cards.toml")?;
        d.cards.count = cards;
        d.workload.input_len = ctx;
        let p = planner.plan(&d)?;
        if let Some(pred) = &p.predicted {
            println!(
                "| {ctx} | {cards} | {:.3} | {:.2} GB | {} |",
                pred.tpot_ms,
                p.attention.kv_bytes as f64 / 1e9,
                if cards == 0 {
                    "GPU alone"
                } else {
                    &pred.breakdown.bound
                }
            );
        }
    }
    Ok(())
}

fn draw(
    path: &Path,
    points: &[(usize, f64, String)],
    batch64: &[(usize, f64, String)],
    alone: f64,
    fits_from: usize,
) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(path, (760, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let afd: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.0 > 0)
        .map(|p| ((p.0 as f64).log2(), p.1))
        .collect();
    let big: Vec<(f64, f64)> = batch64
        .iter()
        .filter(|p| p.0 > 0)
        .map(|p| ((p.0 as f64).log2(), p.1))
        .collect();
    let top = afd.iter().chain(&big).map(|p| p.1).fold(alone, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "GPT-OSS-20B on N Corsair cards: predicted TPOT (afd plan)",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0.8f64..4.2f64, (0.5f64..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("cards")
        .y_desc("TPOT (ms, log scale)")
        .y_labels(12)
        .y_label_formatter(&|y| format!("{y}"))
        .x_labels(5)
        .x_label_formatter(&|x| format!("{}", 2f64.powf(*x).round()))
        .draw()?;
    chart
        .draw_series(LineSeries::new(afd.clone(), BLUE.stroke_width(2)))?
        .label(format!(
            "1x H100 + N cards, batch 1, 1K context (spills below {fits_from} cards)"
        ))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
    chart.draw_series(
        afd.iter()
            .map(|&(x, y)| Circle::new((x, y), 4, BLUE.filled())),
    )?;
    chart
        .draw_series(LineSeries::new(big.clone(), DARK_GREEN.stroke_width(2)))?
        .label("2x H100 + N cards, batch 64, 1K in / 1K out")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], DARK_GREEN.stroke_width(2)));
    chart.draw_series(
        big.iter()
            .map(|&(x, y)| Circle::new((x, y), 4, DARK_GREEN.filled())),
    )?;
    chart
        .draw_series(LineSeries::new(
            vec![(0.8, alone), (4.2, alone)],
            RED.stroke_width(1),
        ))?
        .label(format!("1x H100 alone, batch 1, 1K context: {alone:.2} ms"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED));
    chart
        .draw_series(std::iter::once(Circle::new(
            (3.0, 1.28),
            5,
            BLACK.stroke_width(2),
        )))?
        .label("seed: 8 cards, 1.28 ms")
        .legend(|(x, y)| Circle::new((x + 9, y), 4, BLACK.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let plot = args
        .iter()
        .position(|a| a == "--plot")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    let planner = Planner::new(&load("gpt-oss-20b-1xh100-8cards.toml")?)?;
    seed_table(&planner)?;
    let counts = [0, 2, 3, 4, 6, 8, 12, 16];
    let points = card_sweep(&planner, "gpt-oss-20b-1xh100-8cards.toml", None, &counts)?;
    let batch64 = card_sweep(
        &planner,
        "gpt-oss-20b-2xh100-8cards-batch64.toml",
        Some((1024, 1024)),
        &counts[1..],
    )?;
    batch_sweep(&planner)?;
    long_context(&planner)?;
    if let Some(path) = plot {
        let alone = points.iter().find(|p| p.0 == 0).map_or(0.0, |p| p.1);
        let fits_from = (1..=16)
            .find(|&n| {
                let mut d = load("gpt-oss-20b-1xh100-8cards.toml").ok();
                d.as_mut().is_some_and(|d| {
                    d.cards.count = n;
                    planner.plan(d).is_ok_and(|p| p.fits)
                })
            })
            .unwrap_or(0);
        draw(&path, &points, &batch64, alone, fits_from)?;
        println!("\nwrote {}", path.display());
    }
    Ok(())
}
