//! The card executor's expert FFN on GPT-OSS-20B's expert shape (hidden 2880, intermediate
//! 2880, weights made in memory), at 1 and 32 tokens, MXFP4 and bf16: weight bytes streamed per
//! second against a memcpy of the same bytes measured in the same run, and GFLOP/s.
//!
//! `cargo run --release -p corsair-ffn --example bench_expert [-- --seconds S]`
//!
//! Calls cycle over several experts so the working set is larger than the last-level cache:
//! every call streams one expert's weights from DRAM, as decoding does.

use std::hint::black_box;
use std::time::Instant;

use corsair_ffn::assignment::{PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile};
use corsair_ffn::executor::{ExecOptions, Slot};
use corsair_ffn::format::TileFormat;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::synthetic::{SplitMix, SyntheticLayer, SyntheticWeights, gpt_oss_config};
use corsair_ffn::{Card, CardOptions};
use model::weights::{GatedMlp, WeightFormat};

const HIDDEN: usize = 2880;
const INTER: usize = 2880;

/// The stored bytes of one expert: every row of every matrix (and the MXFP4 scales).
fn expert_bytes(mlp: &GatedMlp) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    for lin in [&mlp.gate, &mlp.up, &mlp.down] {
        let w = &lin.weight;
        parts.extend((0..w.rows()).map(|r| w.row_bytes(r)));
        if w.format() == WeightFormat::Mxfp4 {
            parts.extend((0..w.rows()).map(|r| w.row_scales(r)));
        }
    }
    parts
}

fn time_per_iter(seconds: f64, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..4 {
        f(i);
    }
    let start = Instant::now();
    let mut iters = 0;
    while start.elapsed().as_secs_f64() < seconds || iters < 8 {
        f(iters);
        iters += 1;
    }
    start.elapsed().as_secs_f64() / iters as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut seconds = 1.5;
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--seconds") {
        seconds = args.get(i + 1).ok_or("--seconds needs a value")?.parse()?;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "expert FFN {HIDDEN} x {INTER} (gate+up {}x{HIDDEN}, down {HIDDEN}x{INTER}), {threads} threads available",
        2 * INTER
    );
    println!(
        "{:<6} {:>6} {:>7} {:>9} {:>11} {:>13} {:>13} {:>8} {:>8} {:>9}",
        "format",
        "tokens",
        "threads",
        "ms/call",
        "weights GB/s",
        "memcpy 1t GB/s",
        "memcpy Nt GB/s",
        "vs 1t",
        "vs Nt",
        "GFLOP/s"
    );
    for (format, experts) in [(WeightFormat::Mxfp4, 6usize), (WeightFormat::Bf16, 3usize)] {
        let cfg = gpt_oss_config(1, experts, 1, HIDDEN, INTER, 64);
        let weights = SyntheticWeights::random(&cfg, format, 1, &|_, _| true);
        let stored = StoredFormats {
            experts: TileFormat::from_stored(format),
            ..StoredFormats::uniform(TileFormat::Bf16)
        };
        let plan = plan_placement(
            &cfg,
            &PlacementOptions {
                cards: 1,
                replicas: vec![],
            },
        )?;
        let options = CompileOptions {
            max_tokens: 32,
            ..CompileOptions::default()
        };
        let program = compile(
            &cfg,
            &stored,
            &plan[0],
            &options,
            &HardwareProfile::default(),
        )?
        .program;
        let SyntheticLayer::Moe(mlps) = &weights.layers[0] else {
            return Err("not a MoE layer".into());
        };
        let sources: Vec<Vec<&[u8]>> = mlps
            .iter()
            .map(|m| expert_bytes(m.as_ref().expect("expert made")))
            .collect();
        let bytes: usize = sources[0].iter().map(|s| s.len()).sum();
        let mut dst = vec![0u8; bytes];
        // memcpy of the same bytes, one thread and every thread, cycling over the experts.
        let copy1 = time_per_iter(seconds / 2.0, |i| {
            let mut at = 0;
            for s in &sources[i % experts] {
                dst[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            }
            black_box(&dst);
        });
        let copy_n = time_per_iter(seconds / 2.0, |i| {
            let src = &sources[i % experts];
            let half = src.len() / 2;
            let (a, b) = dst.split_at_mut(src[..half].iter().map(|s| s.len()).sum());
            rayon::join(
                || {
                    let mut at = 0;
                    for s in &src[..half] {
                        a[at..at + s.len()].copy_from_slice(s);
                        at += s.len();
                    }
                },
                || {
                    let mut at = 0;
                    for s in &src[half..] {
                        b[at..at + s.len()].copy_from_slice(s);
                        at += s.len();
                    }
                },
            );
            black_box(&dst);
        });
        for tokens in [1usize, 32] {
            for t in [1, threads] {
                let exec = ExecOptions {
                    threads: t,
                    ..ExecOptions::default()
                };
                let mut card = Card::new(
                    program.clone(),
                    &weights,
                    CardOptions {
                        exec,
                        ..CardOptions::default()
                    },
                )?;
                let mut rng = SplitMix::new(2, tokens as u64);
                let x: Vec<f32> = (0..tokens * HIDDEN).map(|_| rng.symmetric()).collect();
                let per_call = time_per_iter(seconds, |i| {
                    let slots = vec![
                        Slot {
                            expert: (i % experts) as u32,
                            weight: 1.0
                        };
                        tokens
                    ];
                    black_box(card.moe_layer(0, &x, &slots).expect("moe layer"));
                });
                let gbs = bytes as f64 / per_call / 1e9;
                let flops = 2.0 * tokens as f64 * (3 * HIDDEN * INTER) as f64 / per_call / 1e9;
                let (m1, mn) = (bytes as f64 / copy1 / 1e9, bytes as f64 / copy_n / 1e9);
                println!(
                    "{:<6} {:>6} {:>7} {:>9.3} {:>11.1} {:>13.1} {:>13.1} {:>7.0}% {:>7.0}% {:>9.1}",
                    format!("{format:?}").to_lowercase(),
                    tokens,
                    t,
                    per_call * 1e3,
                    gbs,
                    m1,
                    mn,
                    100.0 * gbs / m1,
                    100.0 * gbs / mn,
                    flops
                );
            }
        }
        // The reference forward's kernels on the same expert (model crate), for comparison.
        let mut rng = SplitMix::new(3, 1);
        let x: Vec<f32> = (0..HIDDEN).map(|_| rng.symmetric()).collect();
        let act = cfg.moe.map(|m| m.activation).ok_or("no MoE spec")?;
        let per_call = time_per_iter(seconds, |i| {
            black_box(model::forward::moe::gated_mlp(
                mlps[i % experts].as_ref().expect("expert"),
                act,
                &x,
                1,
            ));
        });
        println!(
            "{:<6} {:>6} {:>7} {:>9.3} {:>11.1}   (model crate's reference kernels, rayon pool)",
            format!("{format:?}").to_lowercase(),
            1,
            "ref",
            per_call * 1e3,
            bytes as f64 / per_call / 1e9
        );
    }
    Ok(())
}
