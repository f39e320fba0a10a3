//! The reference forward's matrix product over a [`WeightMatrix`] in any stored format, in the
//! [`Strided`] order.

use rayon::prelude::*;

use super::{
    BLOCK, BlockFormat, BlockJob, BlockRows, KernelChoice, LANES, Reduction, Strided, Strides,
    block_sums, register_blocks,
};
use crate::weights::WeightMatrix;

/// How far ahead (bytes) the kernel prefetches a matrix's rows: the hardware prefetcher alone
/// left batch-1 decode some 25% short of this (medium Mixtral, 7.9 against 6.0 ms a step).
const PREFETCH_BYTES: usize = 16384;

/// Output rows handled by one parallel task.
const ROWS_PER_TASK: usize = 32;

/// Rows `n0..n0 + count` of `w` against every token, into `tile` (`[count, tokens]`).
struct Tile<'a> {
    x: &'a [f32],
    tokens: usize,
    w: &'a WeightMatrix,
    n0: usize,
    tile: &'a mut [f32],
    kernel: KernelChoice,
}

impl BlockJob for Tile<'_> {
    fn run<const R: usize, const T: usize>(&mut self, r0: usize, t0: usize) {
        let (w, cols) = (self.w, self.w.cols());
        let format = BlockFormat::of(w.format());
        let row = |r: usize| self.n0 + r0 + r;
        let ((data, row_pitch), (scales, scale_pitch)) =
            (w.rows_from(row(0)), w.scales_from(row(0)));
        let rows = BlockRows::<R>::new(
            format,
            data,
            Strides {
                row: row_pitch,
                block: format.block_bytes(),
            },
            scales,
            Strides {
                row: scale_pitch,
                block: 1,
            },
        )
        .with_prefetch(PREFETCH_BYTES);
        let xs: [&[f32]; T] =
            std::array::from_fn(|t| &self.x[(t0 + t) * cols..(t0 + t + 1) * cols]);
        // Whole blocks, then the next 16 values when there are that many, then one by one.
        let reduction = Reduction {
            half: cols % BLOCK >= LANES,
            ..Reduction::whole(0..cols / BLOCK)
        };
        let tail_from = cols / LANES * LANES;
        let (tile, tokens) = (&mut *self.tile, self.tokens);
        block_sums::<Strided, R, T>(
            &rows,
            &xs,
            &reduction,
            self.kernel,
            |_, sums: &[[f32; T]; R]| {
                for (r, sums) in sums.iter().enumerate() {
                    for (t, s) in sums.iter().enumerate() {
                        let mut tail = 0f32;
                        for (k, x) in xs[t].iter().enumerate().skip(tail_from) {
                            tail += w.element(row(r), k) * x;
                        }
                        tile[(r0 + r) * tokens + t0 + t] = s + tail;
                    }
                }
            },
        );
    }
}

/// `out[t, n] = sum_k x[t, k] * w[n, k] + bias[n]` for `tokens` rows of `x` (`[tokens, cols]`),
/// writing `out` (`[tokens, rows]`), in the [`Strided`] order: bitwise [`super::dot`] of the
/// decoded row, plus the bias (or `+0.0`). Runs on the rayon pool.
pub fn matmul(x: &[f32], tokens: usize, w: &WeightMatrix, bias: Option<&[f32]>, out: &mut [f32]) {
    matmul_with(x, tokens, w, bias, out, KernelChoice::Auto)
}

/// [`matmul`] on the path `kernel` picks.
pub fn matmul_with(
    x: &[f32],
    tokens: usize,
    w: &WeightMatrix,
    bias: Option<&[f32]>,
    out: &mut [f32],
    kernel: KernelChoice,
) {
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
        let mut tile = Tile {
            x,
            tokens,
            w,
            n0,
            tile: &mut buf,
            kernel,
        };
        register_blocks(count, tokens, &mut tile);
        (n0, buf)
    };
    // With one thread in the pool, handing the tasks to it would only make this thread sleep
    // while that one runs them (a wake-up each way, per product).
    let tiles: Vec<(usize, Vec<f32>)> = if tasks == 1 || rayon::current_num_threads() == 1 {
        (0..tasks).map(run).collect()
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
