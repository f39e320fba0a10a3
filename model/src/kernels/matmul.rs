//! The reference forward's matrix product over a [`WeightMatrix`] in any stored format, in the
//! [`Strided`] order.

use rayon::prelude::*;

use super::{
    BLOCK, BlockFormat, BlockJob, BlockRows, KernelChoice, LANES, Mxint8Input, Mxint8Row,
    Reduction, Sink, Strided, Strides, bf16_block_sums, bf16_reads_one_input_in_one_pass,
    block_sums, mxint8_block_sums, register_blocks, round_rows, token_quads,
};
use crate::kernels::ActivationDtype;
use crate::weights::{WeightFormat, WeightMatrix};

/// How far ahead (bytes) a register block of several tokens prefetches the matrix: such a
/// block reads its rows side by side, a few streams 1-4 KB apart that the hardware prefetcher
/// does not run far enough ahead of (it left batch-1 decode some 25% short of this on an EPYC
/// host: medium Mixtral, 7.9 against 6.0 ms a step). One token reads the rows one after
/// another, one sequential stream, and prefetches nothing (see `BlockRows::rows_first`).
const PREFETCH_BYTES: usize = 16384;

/// Output rows handled by one parallel task.
const ROWS_PER_TASK: usize = 32;

/// Rows `n0..n0 + count` of `w` against every token, into `tile` (`[tokens, count]`).
struct Tile<'a> {
    x: &'a [f32],
    /// `x` as the matrix's products take it.
    prepared: Prepared<'a>,
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
        .with_prefetch(if T == 1 { 0 } else { PREFETCH_BYTES });
        if let Prepared::Mxint8(q) = self.prepared {
            let xs: [Mxint8Row<'_>; T] = std::array::from_fn(|t| q.row(t0 + t));
            let count = self.tile.len() / self.tokens;
            let tile = &mut *self.tile;
            mxint8_block_sums::<R, T>(
                &rows,
                &xs,
                &Reduction::whole(0..cols / BLOCK),
                self.kernel,
                TileSums {
                    tile,
                    count,
                    r0,
                    t0,
                },
            );
            return;
        }
        if let Prepared::Bf16(xb) = self.prepared {
            // A bf16 matrix's smallest weight is known once for all its products.
            let rows = match w.smallest_exponent() {
                Some(exponent) => rows.with_smallest_weight_exponent(exponent),
                None => rows,
            };
            let xs: [&[u16]; T] =
                std::array::from_fn(|t| &xb[(t0 + t) * cols..(t0 + t + 1) * cols]);
            let count = self.tile.len() / self.tokens;
            let tile = &mut *self.tile;
            bf16_block_sums::<R, T>(
                &rows,
                &xs,
                &Reduction::whole(0..cols / BLOCK),
                self.kernel,
                TileSums {
                    tile,
                    count,
                    r0,
                    t0,
                },
            );
            return;
        }
        let xs: [&[f32]; T] =
            std::array::from_fn(|t| &self.x[(t0 + t) * cols..(t0 + t + 1) * cols]);
        // Whole blocks, then the next 16 values when there are that many, then one by one.
        let reduction = Reduction {
            half: cols % BLOCK >= LANES,
            ..Reduction::whole(0..cols / BLOCK)
        };
        let tail_from = cols / LANES * LANES;
        let count = self.tile.len() / self.tokens;
        let tile = &mut *self.tile;
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
                        tile[(t0 + t) * count + r0 + r] = s + tail;
                    }
                }
            },
        );
    }
}

/// `out[t, n] = sum_k x[t, k] * w[n, k] + bias[n]` for `tokens` rows of `x` (`[tokens, cols]`),
/// writing `out` (`[tokens, rows]`), in the [`Strided`] order: bitwise [`super::dot`] of the
/// decoded row, plus the bias (or `+0.0`); or, where the matrix's products round their inputs
/// to bf16 or quantize them to MXINT8 ([`WeightMatrix::activations`],
/// [`ActivationDtype::numerics`]), in the order of [`super::bf16_partial`] or
/// [`super::mxint8_partial`] on the prepared inputs. Runs on the rayon pool.
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
    let prepared = PreparedInput::new(x, tokens, w);
    // A bf16 matrix's smallest weight is worked out on its first product, here rather than
    // in the pool's tasks, which would wait on one another for it.
    if matches!(prepared.view(), Prepared::Bf16(_)) {
        w.smallest_exponent();
    }
    let tasks = rows.div_ceil(ROWS_PER_TASK);
    // With one thread in the pool, handing the tasks to it would only make this thread sleep
    // while that one runs them (a wake-up each way, per product).
    let serial = tasks == 1 || rayon::current_num_threads() == 1;
    if tokens == 1 {
        // One token: each task's rows are one run of the output, written in place (no tile
        // buffers to allocate and gather, which at batch 1 cost as much as a small product).
        let run = |(task, dst): (usize, &mut [f32])| {
            one_token_rows(
                x,
                prepared.view(),
                w,
                bias,
                task * ROWS_PER_TASK,
                dst,
                kernel,
            )
        };
        if serial {
            out.chunks_mut(ROWS_PER_TASK).enumerate().for_each(run);
        } else {
            out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(run);
        }
        return;
    }
    let run = |task: usize| {
        let n0 = task * ROWS_PER_TASK;
        let count = ROWS_PER_TASK.min(rows - n0);
        let mut buf = vec![0f32; count * tokens];
        let mut tile = Tile {
            x,
            prepared: prepared.view(),
            tokens,
            w,
            n0,
            tile: &mut buf,
            kernel,
        };
        task_blocks(count, tokens, &mut tile);
        (n0, buf)
    };
    let tiles: Vec<(usize, Vec<f32>)> = if serial {
        (0..tasks).map(run).collect()
    } else {
        (0..tasks).into_par_iter().map(run).collect()
    };
    for (n0, buf) in tiles {
        // Token-major in the tile, so each token's run of outputs is one contiguous copy (a
        // row-major walk would write `tokens` lines `rows * 4` bytes apart per row, which for
        // power-of-two widths all fall in one cache set).
        let count = buf.len() / tokens;
        for (t, run) in buf.chunks_exact(count).enumerate() {
            let dst = &mut out[t * rows + n0..t * rows + n0 + count];
            dst.copy_from_slice(run);
            add_bias(bias, n0, dst);
        }
    }
}

/// A task's register blocks over several tokens: bf16 products take all of a whole task's rows
/// against up to 4 tokens at a time, so each token's input is converted once per task and chunk
/// instead of once per 4 rows; other products take the shared grid ([`register_blocks`]). Bf16
/// weights on the AVX2 path take 6 tokens at a time, then the 5, or the 1-4, left: a block's
/// weights, widened once, serve six inputs' multiply-adds, whose twelve accumulators still fit
/// in registers.
fn task_blocks(count: usize, tokens: usize, job: &mut Tile<'_>) {
    if count != ROWS_PER_TASK || !matches!(job.prepared, Prepared::Bf16(_)) {
        register_blocks(count, tokens, job);
        return;
    }
    if job.w.format() != WeightFormat::Bf16 || !bf16_reads_one_input_in_one_pass(job.kernel) {
        token_quads::<ROWS_PER_TASK>(0, tokens, job);
        return;
    }
    let mut t = 0;
    while tokens - t >= 6 {
        job.run::<ROWS_PER_TASK, 6>(0, t);
        t += 6;
    }
    match tokens - t {
        0 => {}
        1 => job.run::<ROWS_PER_TASK, 1>(0, t),
        2 => job.run::<ROWS_PER_TASK, 2>(0, t),
        3 => job.run::<ROWS_PER_TASK, 3>(0, t),
        4 => job.run::<ROWS_PER_TASK, 4>(0, t),
        _ => job.run::<ROWS_PER_TASK, 5>(0, t),
    }
}

/// Where a register block's sums over whole rows (one segment) go: row `r0 + r` of token
/// `t0 + t` at `tile[(t0 + t) * count + r0 + r]`.
struct TileSums<'a> {
    tile: &'a mut [f32],
    count: usize,
    r0: usize,
    t0: usize,
}

impl<const R: usize, const T: usize> Sink<R, T> for TileSums<'_> {
    #[inline(always)]
    fn segment(&mut self, _: usize, sums: &[[f32; T]; R]) {
        for (r, sums) in sums.iter().enumerate() {
            for (t, s) in sums.iter().enumerate() {
                self.tile[(self.t0 + t) * self.count + self.r0 + r] = *s;
            }
        }
    }
}

/// An input as a matrix's products take it (see [`ActivationDtype::numerics`]).
#[derive(Debug, Clone, Copy)]
enum Prepared<'a> {
    /// The f32 values as they are.
    F32,
    /// Rounded to bf16.
    Bf16(&'a [u16]),
    /// Quantized to MXINT8, one row per token.
    Mxint8(&'a Mxint8Input),
}

/// What an input's preparation for a matrix depends on: the numerics, and for MXINT8 whether
/// the weights are MXINT8 (their scale index bases differ from MXFP4's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Preparation(ActivationDtype, bool);

impl Preparation {
    fn of(w: &WeightMatrix) -> Self {
        let format = BlockFormat::of(w.format());
        Preparation(
            w.activations().numerics(format, w.cols()),
            format == BlockFormat::Mxint8,
        )
    }
}

/// The owned form of [`Prepared`].
#[derive(Debug)]
enum PreparedInput {
    F32,
    Bf16(Vec<u16>),
    Mxint8(Mxint8Input),
}

impl PreparedInput {
    /// `tokens` rows of `x` prepared for products with `w`.
    fn new(x: &[f32], tokens: usize, w: &WeightMatrix) -> Self {
        let format = BlockFormat::of(w.format());
        match w.activations().numerics(format, w.cols()) {
            ActivationDtype::F32 => PreparedInput::F32,
            ActivationDtype::Bf16 => {
                let mut xb = Vec::new();
                round_rows(x, &mut xb);
                PreparedInput::Bf16(xb)
            }
            ActivationDtype::Mxint8 => {
                let mut q = Mxint8Input::default();
                q.quantize(x, tokens, w.cols(), format);
                PreparedInput::Mxint8(q)
            }
        }
    }

    fn view(&self) -> Prepared<'_> {
        match self {
            PreparedInput::F32 => Prepared::F32,
            PreparedInput::Bf16(xb) => Prepared::Bf16(xb),
            PreparedInput::Mxint8(q) => Prepared::Mxint8(q),
        }
    }
}

/// Adds the bias (or `+0.0`, which turns a `-0.0` sum into `+0.0` as the definition does) to
/// outputs `n0..` already in `dst`.
fn add_bias(bias: Option<&[f32]>, n0: usize, dst: &mut [f32]) {
    match bias {
        Some(b) => dst.iter_mut().zip(&b[n0..]).for_each(|(d, b)| *d += b),
        None => dst.iter_mut().for_each(|d| *d += 0.0),
    }
}

/// Outputs `n0..n0 + dst.len()` of one token's product, written in place.
fn one_token_rows(
    x: &[f32],
    prepared: Prepared<'_>,
    w: &WeightMatrix,
    bias: Option<&[f32]>,
    n0: usize,
    dst: &mut [f32],
    kernel: KernelChoice,
) {
    register_blocks(
        dst.len(),
        1,
        &mut Tile {
            x,
            prepared,
            tokens: 1,
            w,
            n0,
            tile: &mut *dst,
            kernel,
        },
    );
    add_bias(bias, n0, dst);
}

/// One product of a batch that [`matvecs`] runs together.
#[derive(Debug)]
pub struct MatVec<'a> {
    /// The input row (`w.cols()` values).
    pub x: &'a [f32],
    /// The weights.
    pub w: &'a WeightMatrix,
    /// Bias (`w.rows()` values), if any.
    pub bias: Option<&'a [f32]>,
    /// Where the `w.rows()` outputs go.
    pub out: &'a mut [f32],
}

/// Several one-token products in one parallel section, each the bits [`matmul`] gives it.
/// At batch 1 a layer's products are small (a key projection of medium Mixtral streams in
/// about 13 us), and one hand-over to the pool and one join for all of them replaces one of
/// each per product.
pub fn matvecs(jobs: Vec<MatVec<'_>>) {
    let mut inputs = Vec::with_capacity(jobs.len());
    // Inputs rounded or quantized, once per distinct input and preparation (a layer's products
    // share one).
    let mut preparations: Vec<(&[f32], Preparation, PreparedInput)> = Vec::new();
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, job) in jobs.into_iter().enumerate() {
        let (rows, cols) = (job.w.rows(), job.w.cols());
        assert_eq!(job.x.len(), cols, "matvec input size");
        assert_eq!(job.out.len(), rows, "matvec output size");
        if let Some(b) = job.bias {
            assert_eq!(b.len(), rows, "matvec bias size");
        }
        let how = Preparation::of(job.w);
        let same =
            |(x, h, _): &(&[f32], Preparation, PreparedInput)| std::ptr::eq(*x, job.x) && *h == how;
        let at = preparations.iter().position(same).unwrap_or_else(|| {
            preparations.push((job.x, how, PreparedInput::new(job.x, 1, job.w)));
            preparations.len() - 1
        });
        if matches!(preparations[at].2, PreparedInput::Bf16(_)) {
            // As in `matmul_with`: outside the pool's tasks.
            job.w.smallest_exponent();
        }
        inputs.push((job.x, at, job.w, job.bias));
        for (c, dst) in job.out.chunks_mut(ROWS_PER_TASK).enumerate() {
            tasks.push((i, c * ROWS_PER_TASK, dst));
        }
    }
    let run = |(i, n0, dst): (usize, usize, &mut [f32])| {
        let (x, at, w, bias) = inputs[i];
        let prepared = preparations[at].2.view();
        one_token_rows(x, prepared, w, bias, n0, dst, KernelChoice::Auto);
    };
    if tasks.len() <= 1 || rayon::current_num_threads() == 1 {
        tasks.into_iter().for_each(run);
    } else {
        tasks.into_par_iter().for_each(run);
    }
}
