//! Throughput of the CPU weight kernels per format and token count, beside a memcpy of the
//! same bytes measured in the same run.
//!
//! `cargo run --release -p model --example bench_kernels [ROWS COLS]`

use std::time::Instant;

use model::checkpoint::SharedBytes;
use model::kernels::{ActivationDtype, matmul};
use model::{WeightFormat, WeightMatrix};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (rows, cols) = (
        args.first().copied().unwrap_or(4096),
        args.get(1).copied().unwrap_or(2048),
    );
    let n = rows * cols;
    let bf16: Vec<u8> = (0..n)
        .flat_map(|i| half::bf16::from_f32(((i % 97) as f32 - 48.0) / 97.0).to_le_bytes())
        .collect();
    let f32s: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
    let blocks: Vec<u8> = (0..n / 2).map(|i| (i * 37 % 251) as u8).collect();
    let scales: Vec<u8> = (0..n / 32).map(|i| 120 + (i % 5) as u8).collect();
    let mats = [
        ("f32", WeightMatrix::from_f32(rows, cols, &f32s)),
        (
            "bf16",
            WeightMatrix::from_bytes(WeightFormat::Bf16, rows, cols, SharedBytes::from_vec(bf16)),
        ),
        (
            "mxfp4",
            WeightMatrix::mxfp4(
                rows,
                cols,
                SharedBytes::from_vec(blocks),
                SharedBytes::from_vec(scales),
            ),
        ),
    ];
    // The same matrices with their products' inputs rounded to bf16 (`--activation-dtype
    // bf16`): bf16 and MXFP4 weights take the AVX-512 BF16 dot products where the CPU has them.
    let bf16_inputs: Vec<(&str, WeightMatrix)> = mats
        .iter()
        .filter(|(name, _)| *name != "f32")
        .map(|(name, m)| {
            let label = if *name == "bf16" {
                "bf16 x bf16"
            } else {
                "mxfp4 x bf16"
            };
            (label, m.clone().with_activations(ActivationDtype::Bf16))
        })
        .collect();
    for (name, m) in mats.iter().chain(&bf16_inputs) {
        let bytes = m.stored_bytes();
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let copy = best_of(7, || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
        });
        for tokens in [1usize, 4, 16, 64] {
            let x: Vec<f32> = (0..tokens * cols).map(|i| (i % 13) as f32 * 0.01).collect();
            let mut out = vec![0f32; tokens * rows];
            let t = best_of(7, || {
                matmul(&x, tokens, m, None, &mut out);
                std::hint::black_box(&out);
            });
            println!(
                "{name:>12} {rows}x{cols} tokens {tokens:>2}: {:6.2} ms  {:6.1} GB/s ({:3.0}% of memcpy)  {:6.1} GFLOP/s",
                t * 1e3,
                bytes as f64 / t / 1e9,
                100.0 * copy / t,
                2.0 * (tokens * n) as f64 / t / 1e9
            );
        }
    }
}

fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
