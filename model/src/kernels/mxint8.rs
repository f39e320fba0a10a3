//! The MXINT8 dot-product path: inputs quantized to MXINT8 blocks where they enter a product
//! with MXFP4 or MXINT8 weights, each block's products summed exactly in integers and scaled
//! once. This is how a Corsair card computes (integer MX arithmetic, `hardware.md`) and how
//! llama.cpp computes MXFP4 experts on a CPU (8-bit activations); it is chosen by
//! [`ActivationDtype::Mxint8`](super::ActivationDtype::Mxint8).
//!
//! The definition ([`mxint8_partial`] writes it out):
//!
//! 1. **Inputs**: each 32-element block of `x` (aligned with the weight blocks) becomes 32
//!    int8 values `q` and a shared exponent `e` ([`quantize_block`]): `e = floor(log2(amax)) -
//!    6` for the block's largest magnitude `amax`, `q = clamp(round_ties_even(x / 2^e), -127,
//!    127)`. An all-zero block has `q = 0`; a block holding a NaN or an infinity is marked
//!    non-finite and gives NaN sums.
//! 2. **Weights** as integers `n`: an MXFP4 nibble's value times two (0, ±1, ±2, ±3, ±4, ±6,
//!    ±8, ±12), an MXINT8 byte as it is. With the weight block's E8M0 scale byte `s`, the
//!    block's products are `n * q * 2^k` with `k = s - 127 + e`, less one for MXFP4's halving
//!    ([`block_scale`] gives `2^k` as f32: zero below f32's range, infinity above).
//! 3. **Sums**: 8 f32 lanes from `+0.0`; the blocks in order; lane `i` takes the exact integer
//!    sum of elements `4i..4i + 4`'s products `n * q`, as one fused multiply-add with the
//!    block's scale: `acc[i] = fma(sum, 2^k, acc[i])`; the lanes folded by the halving tree
//!    (`acc[l] += acc[l + width]` for widths 4, 2, 1).
//!
//! Integer sums are exact whatever order adds them, so the AVX2 path (`vpmaddubsw`,
//! `vpmaddwd`) and the portable one give the same bits for every layout, thread count and
//! register blocking.

use super::block::pair_place;
use super::{BLOCK, BlockFormat, BlockRows, KernelChoice, Reduction, Sink};

/// Lanes of the MXINT8 order's sums (one AVX2 register of f32).
pub const MX_LANES: usize = 8;
/// Elements whose integer products one lane adds per block.
const GROUP: usize = BLOCK / MX_LANES;

/// The smallest shared exponent a block can have: `floor(log2(2^-149)) - 6`.
pub const MIN_EXPONENT: i16 = -155;
/// The largest: `floor(log2(f32::MAX)) - 6`.
pub const MAX_EXPONENT: i16 = 121;
/// The exponent that marks a block holding a NaN or an infinity.
pub const NON_FINITE: i16 = i16::MAX;

/// Where a block's scale index starts for a non-finite input block: past every finite index.
const NON_FINITE_BASE: u16 = 540;
/// Entries of [`SCALE_TABLE`]: finite indices up to `255 + 1 + MAX_EXPONENT - MIN_EXPONENT`,
/// then NaN for every scale byte past [`NON_FINITE_BASE`].
const SCALE_TABLE_LEN: usize = NON_FINITE_BASE as usize + 256;

/// FP4 nibble -> its value times two, as an integer.
pub const FP4_TIMES_TWO: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// What [`FP4_OFFSET_TIMES_TWO`] adds to every MXFP4 integer, so that none is negative.
pub const FP4_OFFSET: i32 = 12;

/// FP4 nibble -> its value times two plus [`FP4_OFFSET`]: 0 to 24. The vector paths multiply
/// these unsigned bytes by the signed inputs directly (`vpmaddubsw` wants one operand unsigned)
/// and take away [`FP4_OFFSET`] times each lane's input sum ([`Mxint8Row::offset_sums`]):
/// the same exact integers, without making each product's operand unsigned first.
pub const FP4_OFFSET_TIMES_TWO: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (FP4_TIMES_TWO[i] as i32 + FP4_OFFSET) as u8;
        i += 1;
    }
    t
};

/// `2^k` in f32: exact from 2^-149 to 2^127, zero below, infinity above.
pub const fn power_of_two(k: i32) -> f32 {
    if k > 127 {
        f32::INFINITY
    } else if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else if k >= -149 {
        f32::from_bits(1 << (k + 149))
    } else {
        0.0
    }
}

/// `2^k` for every scale index `i` = weight scale byte + input block's index base
/// ([`Mxint8Input::scale_bases`]): `k = i + MIN_EXPONENT - 128` for finite input blocks (an MXINT8
/// weight's base is one higher), NaN past [`NON_FINITE_BASE`].
pub(super) static SCALE_TABLE: [f32; SCALE_TABLE_LEN] = {
    let mut t = [f32::NAN; SCALE_TABLE_LEN];
    let mut i = 0;
    while i < NON_FINITE_BASE as usize {
        t[i] = power_of_two(i as i32 + MIN_EXPONENT as i32 - 128);
        i += 1;
    }
    t
};

/// [`SCALE_TABLE`] with each entry repeated across one register's [`MX_LANES`] lanes, aligned
/// to a register: the AVX2 path multiplies by a block's scale straight from here, the load
/// folded into its fused multiply-add, where a broadcast would take an instruction of its own
/// per product (25 KB, of which a product reads one entry).
#[repr(C, align(32))]
pub(super) struct WideScaleTable(pub(super) [[f32; MX_LANES]; SCALE_TABLE_LEN]);

/// See [`WideScaleTable`].
pub(super) static WIDE_SCALE_TABLE: WideScaleTable = {
    let mut t = [[0f32; MX_LANES]; SCALE_TABLE_LEN];
    let mut i = 0;
    while i < SCALE_TABLE_LEN {
        t[i] = [SCALE_TABLE[i]; MX_LANES];
        i += 1;
    }
    WideScaleTable(t)
};

/// Block `b`'s scale `2^k` (step 2 of the definition) for weights of `format` with scale byte
/// `weight_scale`, against an input block of shared exponent `exponent`.
pub fn block_scale(format: BlockFormat, weight_scale: u8, exponent: i16) -> f32 {
    SCALE_TABLE[usize::from(weight_scale) + usize::from(scale_base(format, exponent))]
}

/// The index base of an input block of shared exponent `exponent` against `format` weights.
fn scale_base(format: BlockFormat, exponent: i16) -> u16 {
    if exponent == NON_FINITE {
        return NON_FINITE_BASE;
    }
    let halving = u16::from(format != BlockFormat::Mxint8);
    // Finite exponents lie in MIN_EXPONENT..=MAX_EXPONENT (see `quantize_block`).
    (exponent - MIN_EXPONENT) as u16 + 1 - halving
}

/// One 32-element input block quantized (step 1 of the definition): the int8 values and the
/// shared exponent (or [`NON_FINITE`]).
pub fn quantize_block(x: &[f32]) -> ([i8; BLOCK], i16) {
    debug_assert_eq!(x.len(), BLOCK);
    let mut q = [0i8; BLOCK];
    let mut amax = 0f32;
    for &v in x {
        if !v.is_finite() {
            return (q, NON_FINITE);
        }
        amax = amax.max(v.abs());
    }
    if amax == 0.0 {
        return (q, MIN_EXPONENT);
    }
    let e = floor_log2(amax) - 6;
    // x / 2^e in two exact steps where 2^-e is past f32's range (e < -127): scaling up by a
    // power of two is exact, and the quotient is below 128 in magnitude.
    let (first, second) = if e < -127 {
        (power_of_two(127), power_of_two(-e - 127))
    } else {
        (power_of_two(-e), 1.0)
    };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_to_int8(v * first * second);
    }
    (q, e as i16)
}

/// `floor(log2(v))` of a positive finite f32 (subnormals included).
fn floor_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    let biased = (bits >> 23) as i32;
    if biased > 0 {
        biased - 127
    } else {
        // Subnormal: the mantissa's leading one sets the exponent.
        (31 - bits.leading_zeros() as i32) - 149
    }
}

/// `v` (below 128 in magnitude) rounded to the nearest integer, ties to even, clamped to
/// ±127. Adding and taking away 1.5 * 2^23 rounds in the FPU's default mode without calling
/// a library `rint` on CPUs built without SSE4.1.
#[inline(always)]
fn round_to_int8(v: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    let r = (v + MAGIC) - MAGIC;
    r.clamp(-127.0, 127.0) as i8
}

/// Inputs quantized to MXINT8 for one matrix's products: one row per token, each of whole
/// blocks (zero-padded), with a scale index base per block.
#[derive(Debug, Clone, Default)]
pub struct Mxint8Input {
    values: Vec<i8>,
    exponents: Vec<i16>,
    bases: Vec<u16>,
    /// [`FP4_OFFSET`] times each lane's sum of its four values, [`MX_LANES`] per block.
    offset_sums: Vec<i32>,
    blocks: usize,
}

impl Mxint8Input {
    /// Quantizes `rows` rows of `x` (`[rows, cols]`) for products with `format` weights,
    /// reusing this value's buffers.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, format: BlockFormat) {
        assert_eq!(x.len(), rows * cols, "quantize: input size");
        self.blocks = cols.div_ceil(BLOCK);
        self.values.clear();
        self.values.resize(rows * self.blocks * BLOCK, 0);
        self.exponents.clear();
        self.bases.clear();
        self.offset_sums.clear();
        let mut padded = [0f32; BLOCK];
        for (row, dst) in x
            .chunks_exact(cols.max(1))
            .zip(self.values.chunks_exact_mut(self.blocks * BLOCK))
        {
            for (b, dst) in dst.chunks_exact_mut(BLOCK).enumerate() {
                let src = &row[b * BLOCK..((b + 1) * BLOCK).min(cols)];
                padded[..src.len()].copy_from_slice(src);
                padded[src.len()..].fill(0.0);
                let (q, e) = quantize_block(&padded);
                dst.copy_from_slice(&q);
                self.offset_sums.extend(
                    q.chunks_exact(GROUP)
                        .map(|lane| FP4_OFFSET * lane.iter().map(|&v| i32::from(v)).sum::<i32>()),
                );
                self.exponents.push(e);
                self.bases.push(scale_base(format, e));
            }
        }
    }

    /// The quantized input `t`.
    pub fn row(&self, t: usize) -> Mxint8Row<'_> {
        let b = self.blocks;
        Mxint8Row {
            values: &self.values[t * b * BLOCK..(t + 1) * b * BLOCK],
            exponents: &self.exponents[t * b..(t + 1) * b],
            bases: &self.bases[t * b..(t + 1) * b],
            offset_sums: &self.offset_sums[t * b * MX_LANES..(t + 1) * b * MX_LANES],
        }
    }
}

/// One quantized input row (see [`Mxint8Input`]).
#[derive(Debug, Clone, Copy)]
pub struct Mxint8Row<'a> {
    /// Int8 values, block after block in element order.
    pub values: &'a [i8],
    /// Each block's shared exponent (or [`NON_FINITE`]).
    pub exponents: &'a [i16],
    /// Each block's scale index base for the weight format it was quantized for: a block's
    /// scale is `SCALE_TABLE[weight scale byte + base]`.
    pub(super) bases: &'a [u16],
    /// Each block's [`FP4_OFFSET`] times the sums of its lanes' values (elements `4i..4i + 4`
    /// for lane `i`), [`MX_LANES`] per block.
    pub(super) offset_sums: &'a [i32],
}

impl<'a> Mxint8Row<'a> {
    /// Whole blocks held.
    pub fn blocks(&self) -> usize {
        self.exponents.len()
    }

    /// The same row from block `b` on.
    pub fn from_block(self, b: usize) -> Mxint8Row<'a> {
        Mxint8Row {
            values: &self.values[b * BLOCK..],
            exponents: &self.exponents[b..],
            bases: &self.bases[b..],
            offset_sums: &self.offset_sums[b * MX_LANES..],
        }
    }
}

/// The integer weight values `n` of block `b` of row `r`, in element order.
pub(super) fn weight_integers<const R: usize>(
    w: &BlockRows<'_, R>,
    r: usize,
    b: usize,
) -> [i8; 32] {
    let at = w.data_at(r, b);
    match w.format {
        BlockFormat::Mxfp4 => std::array::from_fn(|k| {
            let byte = w.data[at + k / 2];
            FP4_TIMES_TWO[usize::from((byte >> (4 * (k % 2))) & 0x0f)]
        }),
        BlockFormat::Mxfp4RowPairs => {
            let shift = 4 * u32::from(pair_place(r, w.pair_offset).1);
            std::array::from_fn(|k| FP4_TIMES_TWO[usize::from((w.data[at + k] >> shift) & 0x0f)])
        }
        BlockFormat::Mxint8 => std::array::from_fn(|k| w.data[at + k] as i8),
        other => unreachable!("the MXINT8 path reads MX weights, not {other:?}"),
    }
}

/// The halving tree over the 8 lanes: widths 4, 2, 1.
#[inline(always)]
pub fn fold_mx_lanes(acc: [f32; MX_LANES]) -> f32 {
    super::halving_fold(acc)
}

/// Step 3 for one block: the lanes `acc` take the block's products of integers `n` and `q`.
#[inline(always)]
fn add_block(acc: &mut [f32; MX_LANES], n: &[i8; BLOCK], q: &[i8], scale: f32) {
    for (l, a) in acc.iter_mut().enumerate() {
        let sum: i32 = (GROUP * l..GROUP * (l + 1))
            .map(|k| i32::from(n[k]) * i32::from(q[k]))
            .sum();
        *a = (sum as f32).mul_add(scale, *a);
    }
}

/// `w . x` over blocks `blocks` in the MXINT8 order, written from its definition: `n` the
/// weights' integers (block after block), `scales` their scale bytes, `x` the quantized input.
pub fn mxint8_partial(
    format: BlockFormat,
    n: &[i8],
    scales: &[u8],
    x: &Mxint8Row<'_>,
    blocks: std::ops::Range<usize>,
) -> f32 {
    let mut acc = [0f32; MX_LANES];
    for b in blocks {
        let nb: [i8; BLOCK] = std::array::from_fn(|k| n[b * BLOCK + k]);
        let scale = block_scale(format, scales[b], x.exponents[b]);
        add_block(&mut acc, &nb, &x.values[b * BLOCK..(b + 1) * BLOCK], scale);
    }
    fold_mx_lanes(acc)
}

/// [`super::block_sums`] in the MXINT8 order: `w` holds MXFP4 (plain or in row pairs) or
/// MXINT8 blocks, each `x[t]` an input quantized for that format ([`Mxint8Input`]) holding at
/// least `blocks.end` blocks.
///
/// # Panics
/// If the format is another, a half block is asked for, or a row or input is too short.
pub fn mxint8_block_sums<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[Mxint8Row<'_>; T],
    reduction: &Reduction,
    kernel: KernelChoice,
    emit: impl Sink<R, T>,
) {
    assert!(reduction.segment > 0, "segments of no blocks");
    assert!(
        matches!(
            w.format,
            BlockFormat::Mxfp4 | BlockFormat::Mxfp4RowPairs | BlockFormat::Mxint8
        ),
        "the MXINT8 path reads MXFP4 or MXINT8 weights"
    );
    assert!(!reduction.half, "the MXINT8 path sums whole blocks");
    w.check(reduction.blocks.end, false);
    assert!(
        x.iter().all(|x| x.blocks() >= reduction.blocks.end
            && x.values.len() >= x.blocks() * BLOCK
            && x.bases.len() == x.blocks()
            && x.offset_sums.len() == x.blocks() * MX_LANES),
        "kernel input rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: the CPU features were just detected; the rows and inputs were checked above
        // to hold every block the kernel reads.
        return unsafe { super::avx2_mxint8::block_sums::<R, T>(w, x, reduction, emit) };
    }
    let _ = kernel;
    portable::<R, T>(w, x, reduction, emit)
}

/// The MXINT8 order one lane at a time (sizes already checked).
fn portable<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[Mxint8Row<'_>; T],
    reduction: &Reduction,
    mut emit: impl Sink<R, T>,
) {
    for s in 0..reduction.segments() {
        let mut out = [[0f32; T]; R];
        for (r, out) in out.iter_mut().enumerate() {
            let mut acc = [[0f32; MX_LANES]; T];
            for b in reduction.segment_blocks(s) {
                let n = weight_integers(w, r, b);
                let scale_byte = w.scales[w.scale_at(r, b)];
                for (acc, x) in acc.iter_mut().zip(x) {
                    let scale = SCALE_TABLE[usize::from(scale_byte) + usize::from(x.bases[b])];
                    add_block(acc, &n, &x.values[b * BLOCK..(b + 1) * BLOCK], scale);
                }
            }
            for (o, acc) in out.iter_mut().zip(acc) {
                *o = fold_mx_lanes(acc);
            }
        }
        emit.segment(s, &out);
    }
}
