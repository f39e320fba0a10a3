//! The card executor's expert FFN on GPT-OSS-20B's expert shape (hidden 2880, intermediate
//! 2880, or another: `--hidden`, `--intermediate`; weights made in memory), at 1 to 32 tokens,
//! MXFP4 and bf16: weight bytes streamed per second against a memcpy of the same bytes
//! measured in the same run, and GFLOP/s; then the reference forward's kernels
//! (`model::forward::moe::gated_mlp`) on the same experts and token counts, on the rayon pool
//! (set `RAYON_NUM_THREADS=1` to compare with one card thread).
//!
//! `cargo run --release -p corsair-ffn --example bench_expert [-- --seconds S] [--format mxfp4|bf16]
//! [--tokens N] [--threads N] [--activations f32|bf16|mxint8] [--experts N] [--kernel-only]
//! [--hidden N] [--intermediate N]`
//!
//! Calls cycle over several experts (6 MXFP4 or 3 bf16 ones, or `--experts N`) so the working
//! set is larger than the last-level cache: every call streams one expert's weights from DRAM,
//! as decoding does. `--kernel-only` times the executor alone (no memcpy, no reference), for
//! runs of two processes side by side or under a profiler.

use std::hint::black_box;
use std::time::Instant;

use corsair_ffn::assignment::{PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile};
use corsair_ffn::executor::{ExecOptions, Slot};
use corsair_ffn::format::TileFormat;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::synthetic::{SplitMix, SyntheticLayer, SyntheticWeights, gpt_oss_config};
use corsair_ffn::{Card, CardOptions};
use model::kernels::ActivationDtype;
use model::weights::{GatedMlp, WeightFormat};

/// GPT-OSS-20B's expert shape, the default (`--hidden`, `--intermediate` take another: the
/// medium Mixtral's is 768 and 2,048).
const HIDDEN: usize = 2880;
const INTER: usize = 2880;
/// Token counts timed: decode of one sequence, the few rows an expert gets in a decode batch,
/// and a prompt chunk's worth.
const TOKENS: [usize; 5] = [1, 2, 4, 8, 32];

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

/// Median of `v` (the mean of the middle two of an even count, as numpy and afd-loadtest
/// report it); NaN when empty.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Seconds of one call of `f`.
fn timed(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

/// Copies one expert's bytes into `dst` on `threads` threads (1 or 2 halves).
fn memcpy(src: &[&[u8]], dst: &mut [u8], threads: usize) {
    let copy = |parts: &[&[u8]], out: &mut [u8]| {
        let mut at = 0;
        for s in parts {
            out[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        }
    };
    if threads == 1 {
        copy(src, dst);
    } else {
        let half = src.len() / 2;
        let (a, b) = dst.split_at_mut(src[..half].iter().map(|s| s.len()).sum());
        rayon::join(|| copy(&src[..half], a), || copy(&src[half..], b));
    }
    black_box(dst);
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let seconds: f64 = flag("--seconds").map_or(Ok(2.0), |v| v.parse())?;
    let hidden: usize = flag("--hidden").map_or(Ok(HIDDEN), |v| v.parse())?;
    let inter: usize = flag("--intermediate").map_or(Ok(INTER), |v| v.parse())?;
    if hidden == 0 || inter == 0 || !hidden.is_multiple_of(32) || !inter.is_multiple_of(32) {
        return Err(format!(
            "--hidden {hidden} and --intermediate {inter} must be positive multiples of 32"
        )
        .into());
    }
    // Optional filters: --format mxfp4|bf16, --tokens N, --threads N.
    let only_format = flag("--format").cloned();
    let only_tokens: Option<usize> = flag("--tokens").map(|v| v.parse()).transpose()?;
    let only_threads: Option<usize> = flag("--threads").map(|v| v.parse()).transpose()?;
    // What the products round their inputs to, as `--activation-dtype` sets it for a
    // deployment (bf16: AVX-512 BF16 dot products; mxint8: integer block sums).
    let activations: ActivationDtype =
        flag("--activations").map_or(Ok(ActivationDtype::F32), |v| v.parse())?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "expert FFN: gate+up {}x{hidden}, down {hidden}x{inter}; {threads} threads available; \
         each round times memcpy (1 and {threads} threads) and the executor on the same experts; medians",
        2 * inter
    );
    println!(
        "{:<6} {:>6} {:>7} {:>9} {:>12} {:>13} {:>13} {:>7} {:>7} {:>8}",
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
    let kernel_only = args.iter().any(|a| a == "--kernel-only");
    let only_experts: Option<usize> = flag("--experts").map(|v| v.parse()).transpose()?;
    if only_experts == Some(0) {
        return Err("--experts needs at least 1".into());
    }
    for (format, experts) in [(WeightFormat::Mxfp4, 6usize), (WeightFormat::Bf16, 3usize)] {
        let experts = only_experts.unwrap_or(experts);
        let name = format!("{format:?}").to_lowercase();
        if only_format.as_deref().is_some_and(|f| f != name) {
            continue;
        }
        let cfg = gpt_oss_config(1, experts, 1, hidden, inter, 64);
        let mut weights = SyntheticWeights::random(&cfg, format, 1, &|_, _| true);
        for layer in &mut weights.layers {
            if let SyntheticLayer::Moe(mlps) = layer {
                for l in mlps.iter_mut().flatten() {
                    for lin in [&mut l.gate, &mut l.up, &mut l.down] {
                        lin.weight.set_activations(activations);
                    }
                }
            }
        }
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
            activations,
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
        let mlps: Vec<&GatedMlp> = mlps
            .iter()
            .map(|m| m.as_ref().ok_or("expert missing"))
            .collect::<Result<_, _>>()?;
        let sources: Vec<Vec<&[u8]>> = mlps.iter().map(|m| expert_bytes(m)).collect();
        let bytes: usize = sources[0].iter().map(|s| s.len()).sum();
        let mut dst = vec![0u8; bytes];
        for tokens in TOKENS {
            for t in [1, threads] {
                if only_tokens.is_some_and(|n| n != tokens) || only_threads.is_some_and(|n| n != t)
                {
                    continue;
                }
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
                let x: Vec<f32> = (0..tokens * hidden).map(|_| rng.symmetric()).collect();
                let mut call = |e: usize| {
                    let slots = vec![
                        Slot {
                            expert: e as u32,
                            weight: 1.0
                        };
                        tokens
                    ];
                    black_box(card.moe_layer(0, &x, &slots).expect("moe layer"));
                };
                for e in 0..experts {
                    call(e);
                }
                let (mut k, mut c1, mut cn) = (Vec::new(), Vec::new(), Vec::new());
                let start = Instant::now();
                while start.elapsed().as_secs_f64() < seconds || k.len() < 5 {
                    if kernel_only {
                        c1.push(f64::NAN);
                        cn.push(f64::NAN);
                    } else {
                        c1.push(
                            (0..experts)
                                .map(|e| timed(|| memcpy(&sources[e], &mut dst, 1)))
                                .sum::<f64>()
                                / experts as f64,
                        );
                        cn.push(
                            (0..experts)
                                .map(|e| timed(|| memcpy(&sources[e], &mut dst, threads)))
                                .sum::<f64>()
                                / experts as f64,
                        );
                    }
                    k.push((0..experts).map(|e| timed(|| call(e))).sum::<f64>() / experts as f64);
                }
                let ratio = |c: &[f64]| median(c.iter().zip(&k).map(|(c, k)| c / k).collect());
                let (r1, rn) = (ratio(&c1), ratio(&cn));
                let per_call = median(k.clone());
                let gbs = bytes as f64 / per_call / 1e9;
                let flops = 2.0 * tokens as f64 * (3 * hidden * inter) as f64 / per_call / 1e9;
                println!(
                    "{name:<6} {tokens:>6} {t:>7} {:>9.3} {gbs:>12.1} {:>13.1} {:>13.1} {:>6.0}% {:>6.0}% {flops:>8.1}",
                    per_call * 1e3,
                    bytes as f64 / median(c1) / 1e9,
                    bytes as f64 / median(cn) / 1e9,
                    100.0 * r1,
                    100.0 * rn,
                );
            }
        }
        if kernel_only {
            continue;
        }
        // The reference forward's kernels (model crate, rayon pool) on the same experts.
        let act = cfg.moe.map(|m| m.activation).ok_or("no MoE spec")?;
        for tokens in TOKENS {
            if only_tokens.is_some_and(|n| n != tokens) {
                continue;
            }
            let mut rng = SplitMix::new(3, tokens as u64);
            let x: Vec<f32> = (0..tokens * hidden).map(|_| rng.symmetric()).collect();
            let mut r = Vec::new();
            let start = Instant::now();
            while start.elapsed().as_secs_f64() < seconds / 2.0 || r.len() < 5 {
                r.push(
                    (0..experts)
                        .map(|e| {
                            timed(|| {
                                black_box(model::forward::moe::gated_mlp(mlps[e], act, &x, tokens));
                            })
                        })
                        .sum::<f64>()
                        / experts as f64,
                );
            }
            let per_call = median(r);
            let flops = 2.0 * tokens as f64 * (3 * hidden * inter) as f64 / per_call / 1e9;
            println!(
                "{name:<6} {tokens:>6} {:>7} {:>9.3} {:>12.1} {:>44} {flops:>8.1}",
                format!("ref {}", rayon::current_num_threads()),
                per_call * 1e3,
                bytes as f64 / per_call / 1e9,
                "(model crate's reference kernels)",
            );
        }
    }
    Ok(())
}
