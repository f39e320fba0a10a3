//! CPU matrix kernels over [`WeightMatrix`] in any stored format.
//!
//! `out[t, n] = sum_k x[t, k] * w[n, k]` with f32 accumulation in one fixed order: 16 lane
//! sums over `k` (lane `l` takes every `k = l mod 16`), a fixed halving tree, then the scalar
//! tail. That order does not depend on the number of tokens, the blocking, the thread count or
//! the instruction set, so a row's result is bitwise the same alone or in a batch (batch
//! invariance), and equal to [`dot`] on the decoded row.
//!
//! Weights are decoded 16 values at a time in registers inside the loop (bf16 is a shift, MXFP4
//! a table look-up), never expanded to f32 in memory. A register block of 4 weight rows x 4
//! tokens reuses every decoded weight for 4 tokens and every token chunk for 4 rows.
//! candle's CPU matmul is not used for weights: it is some 20x slower on bf16 and cannot read
//! MXFP4 at all.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
pub use avx512::fold as fold_lanes_avx512;

use crate::mxfp4;
use crate::weights::WeightMatrix;

/// Lanes of the fixed-order dot product (one AVX-512 register of f32).
pub const LANES: usize = 16;

/// Output rows handled by one parallel task.
const ROWS_PER_TASK: usize = 32;

/// Reduces lane sums with the fixed halving tree.
#[inline(always)]
pub(crate) fn reduce(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Dot product in the kernels' fixed order (the definition every kernel path reproduces).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let full = a.len() / LANES * LANES;
    for (ca, cb) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut tail = 0f32;
    for i in full..a.len() {
        tail += a[i] * b[i];
    }
    reduce(acc) + tail
}

/// Portable path: decode each weight row into a buffer, then [`dot`] with every token.
fn tile_portable(
    x: &[f32],
    tokens: usize,
    w: &WeightMatrix,
    n0: usize,
    count: usize,
    tile: &mut [f32],
) {
    let cols = w.cols();
    let mut row = vec![0f32; cols];
    for (i, out) in tile.chunks_exact_mut(tokens).take(count).enumerate() {
        w.decode_row(n0 + i, mxfp4::scale_table(), &mut row);
        for (t, o) in out.iter_mut().enumerate() {
            *o = dot(&x[t * cols..(t + 1) * cols], &row);
        }
    }
}

/// Computes output rows `[n0, n0 + count)` for every token into `tile` (`[count, tokens]`),
/// on the widest instruction set this CPU has. Every path computes the same bits: the
/// arithmetic (separate multiply and add, no contraction) and its order are the same.
fn tile(x: &[f32], tokens: usize, w: &WeightMatrix, n0: usize, count: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available() {
            // SAFETY: the features were just detected on this CPU.
            return unsafe { avx512::tile(x, tokens, w, n0, count, out) };
        }
    }
    tile_portable(x, tokens, w, n0, count, out)
}

/// `out[t, n] = sum_k x[t, k] * w[n, k] + bias[n]` for `tokens` rows of `x` (`[tokens, cols]`),
/// writing `out` (`[tokens, rows]`). Runs on the rayon pool.
pub fn matmul(x: &[f32], tokens: usize, w: &WeightMatrix, bias: Option<&[f32]>, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), tokens * cols, "matmul input size");
    assert_eq!(out.len(), tokens * rows, "matmul output size");
    if let Some(b) = bias {
        assert_eq!(b.len(), rows, "matmul bias size");
    }
    if tokens == 0 || rows == 0 {
        return;
    }
    let tasks = rows.div_ceil(ROWS_PER_TASK);
    let run = |task: usize| {
        let n0 = task * ROWS_PER_TASK;
        let count = ROWS_PER_TASK.min(rows - n0);
        let mut buf = vec![0f32; count * tokens];
        tile(x, tokens, w, n0, count, &mut buf);
        (n0, buf)
    };
    let tiles: Vec<(usize, Vec<f32>)> = if tasks == 1 {
        vec![run(0)]
    } else {
        (0..tasks).into_par_iter().map(run).collect()
    };
    for (n0, buf) in tiles {
        for (i, col) in buf.chunks_exact(tokens).enumerate() {
            let b = bias.map_or(0.0, |b| b[n0 + i]);
            for (t, v) in col.iter().enumerate() {
                out[t * rows + n0 + i] = v + b;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
