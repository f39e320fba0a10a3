//! Each linear kernel against its CPU twin (`gpu-attention/src/device/twins.rs`, which walks the
//! data as the kernel does) at awkward shapes: token counts that leave a tile part full (1, 7, 8,
//! 9, 65), row counts that leave a block part full (1, 7, 9, 17), features past one lane stride,
//! the half kernels' 16-byte and single-load paths, MXFP4 rows of 1, 3 and 33 blocks. The device
//! runs the kernels, candle's CPU device the twins; a kernel's output may differ from its twin's
//! only by the rounding of fused multiply-adds.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use gpu_attention::device::linear::{HalfLinear, Mxfp4Linear};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TOKENS: [usize; 5] = [1, 7, 8, 9, 65];
const ROWS: [usize; 4] = [1, 7, 9, 17];

/// Values from a seed, in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// The op on `dev` and on the CPU, flattened: `(kernel, twin)`.
fn both(dev: &Device, op: impl Fn(&Device) -> Result<Tensor>) -> Result<(Vec<f32>, Vec<f32>)> {
    let flat = |t: Tensor| -> Result<Vec<f32>> {
        Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
    };
    Ok((flat(op(dev)?)?, flat(op(&Device::Cpu)?)?))
}

/// Whether every output is within `1e-5` of the sum of its products' sizes (`bound`, one per
/// output) of the twin's; prints the first that is not.
fn agrees(what: &str, kernel: &[f32], twin: &[f32], bound: &[f64]) -> bool {
    if kernel.len() != twin.len() {
        println!(
            "   {what}: {} outputs against the twin's {}",
            kernel.len(),
            twin.len()
        );
        return false;
    }
    for (i, ((g, w), b)) in kernel.iter().zip(twin).zip(bound).enumerate() {
        if (f64::from(*g) - f64::from(*w)).abs() > 1e-5 * b + 1e-30 {
            println!("   {what}: output {i} is {g}, the twin's {w}");
            return false;
        }
    }
    true
}

/// `sum_k |x[t, k] * w[r, k]|` for every output `[t, r]`.
fn bounds(x: &[f32], w: &[f32], n: usize, k: usize, rows: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n * rows);
    for t in 0..n {
        for r in 0..rows {
            let xs = &x[t * k..(t + 1) * k];
            let ws = &w[r * k..(r + 1) * k];
            out.push(
                xs.iter()
                    .zip(ws)
                    .map(|(a, b)| f64::from((a * b).abs()))
                    .sum(),
            );
        }
    }
    out
}

/// Runs every shape; returns the checks that failed.
pub fn run(dev: &Device) -> Result<usize> {
    println!("-- linear kernels against their CPU twins");
    let (mut checks, mut failures) = (0, 0);
    for &n in &TOKENS {
        for &rows in &ROWS {
            // 8 and 264 features take 16-byte loads (264 leaves lanes past the first stride); 36
            // single loads.
            for k in [8usize, 36, 264] {
                let x = values(n * k, (n * 131 + k) as u64);
                let w = values(rows * k, (rows * 17 + k) as u64);
                let bound = bounds(&x, &w, n, k, rows);
                for dtype in [DType::BF16, DType::F16] {
                    let (kernel, twin) = both(dev, |d| {
                        let xt = Tensor::from_vec(x.clone(), (n, k), d)?;
                        let wt = Tensor::from_vec(w.clone(), (rows, k), d)?.to_dtype(dtype)?;
                        Ok(xt.apply_op2(&wt, HalfLinear)?)
                    })?;
                    checks += 1;
                    let what = format!("{dtype:?} linear, {n} tokens, {rows} rows, {k} features");
                    failures += usize::from(!agrees(&what, &kernel, &twin, &bound));
                }
            }
            // MXFP4 rows of 1, 3 and 33 blocks (33: lane 0 takes a second block).
            for k in [32usize, 96, 33 * 32] {
                let x = values(n * k, (n * 7 + k) as u64);
                let blocks: Vec<u8> = values(rows * k / 2, (rows + k) as u64)
                    .into_iter()
                    .map(|v| ((v + 1.0) * 127.5) as u8)
                    .collect();
                let scales: Vec<u8> = (0..rows * k / 32).map(|i| 124 + (i % 6) as u8).collect();
                // Bound from the decoded weights' largest size (6 times the largest scale).
                let big = 6.0 * 2f32.powi(129 - 127);
                let bound: Vec<f64> = (0..n * rows)
                    .map(|o| {
                        let t = o / rows;
                        x[t * k..(t + 1) * k]
                            .iter()
                            .map(|a| f64::from((a * big).abs()))
                            .sum()
                    })
                    .collect();
                let (kernel, twin) = both(dev, |d| {
                    let xt = Tensor::from_vec(x.clone(), (n, k), d)?;
                    let bt = Tensor::from_vec(blocks.clone(), (rows, k / 2), d)?;
                    let st = Tensor::from_vec(scales.clone(), (rows, k / 32), d)?;
                    Ok(xt.apply_op3(&bt, &st, Mxfp4Linear)?)
                })?;
                checks += 1;
                let what = format!("MXFP4 linear, {n} tokens, {rows} rows, {k} features");
                failures += usize::from(!agrees(&what, &kernel, &twin, &bound));
            }
        }
    }
    println!("   {} of {checks} shapes agree", checks - failures);
    Ok(failures)
}
