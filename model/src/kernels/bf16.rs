//! The bf16 dot-product path: activations rounded once to bf16 where they enter a product with
//! bf16 or MXFP4 weights, pairs of products added by the CPU's AVX-512 BF16 instruction
//! (`vdpbf16ps`), or by two AVX2 fused multiply-adds where it has none, sums kept in f32.
//! This is what a bf16 model computes in PyTorch and a bf16 GGUF in llama.cpp. It is chosen by
//! [`ActivationDtype::Bf16`]; the default ([`ActivationDtype::F32`]) keeps the exact f32 orders
//! of [`super::SumOrder`] and every fixture contract that rests on them.
//!
//! The order ([`bf16_partial`] is its definition): 16 f32 lanes from `+0.0`; the 32-element
//! blocks in order; in each, lane `l` takes element `2l + 1`, then element `2l` (the order the
//! instruction adds a pair in), each as one fused multiply-add of the bf16 weight and the bf16
//! input; the lanes folded by [`super::fold_lanes`]. Like the instruction, it treats inputs
//! below f32's normal range as zero and flushes such results to zero (see [`flushed_term`]).
//! It depends on nothing but the values, so every register blocking, thread count and tiling
//! gives the same bits, and the portable and AVX2 paths give the AVX-512 path's.

use super::{BLOCK, BlockFormat, BlockRows, KernelChoice, LANES, Reduction, Sink, fold_lanes};

/// The type activations are rounded to where they enter a matrix product.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ActivationDtype {
    /// f32 throughout: the exact orders the fixtures and bit-exactness tests rest on.
    #[default]
    F32,
    /// bf16 inputs against bf16 and MXFP4 weights (rows of whole 32-element blocks), f32 sums;
    /// other weight formats keep f32 inputs.
    Bf16,
    /// Inputs quantized to MXINT8 against MXFP4 and MXINT8 weights, integer block sums (the
    /// Corsair card's arithmetic, see [`super::mxint8_partial`]); bf16 inputs against bf16
    /// weights as [`ActivationDtype::Bf16`]; rows of whole 32-element blocks only, other
    /// products keep f32 inputs.
    Mxint8,
}

impl ActivationDtype {
    /// What a product with weights of `format` and rows of `cols` elements computes under this
    /// setting: [`ActivationDtype::F32`] (the exact orders), [`ActivationDtype::Bf16`] (the
    /// bf16 order) or [`ActivationDtype::Mxint8`] (the MXINT8 order).
    pub fn numerics(self, format: BlockFormat, cols: usize) -> ActivationDtype {
        let mx = matches!(
            format,
            BlockFormat::Mxfp4 | BlockFormat::Mxfp4RowPairs | BlockFormat::Mxint8
        );
        let bf16 = matches!(
            format,
            BlockFormat::Bf16 | BlockFormat::Mxfp4 | BlockFormat::Mxfp4RowPairs
        );
        match self {
            _ if !cols.is_multiple_of(BLOCK) => ActivationDtype::F32,
            ActivationDtype::Mxint8 if mx => ActivationDtype::Mxint8,
            ActivationDtype::Mxint8 | ActivationDtype::Bf16 if bf16 => ActivationDtype::Bf16,
            _ => ActivationDtype::F32,
        }
    }

    /// Whether a product with weights of `format` and rows of `cols` elements rounds its
    /// inputs to bf16 under this setting.
    pub fn rounds(self, format: BlockFormat, cols: usize) -> bool {
        self.numerics(format, cols) == ActivationDtype::Bf16
    }
}

impl std::str::FromStr for ActivationDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" | "float" => Ok(ActivationDtype::F32),
            "bf16" | "bfloat16" => Ok(ActivationDtype::Bf16),
            "mxint8" => Ok(ActivationDtype::Mxint8),
            other => Err(format!(
                "unknown activation dtype `{other}`: expected f32 (exact, the default), bf16 \
                 or mxint8"
            )),
        }
    }
}

impl std::fmt::Display for ActivationDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ActivationDtype::F32 => "f32",
            ActivationDtype::Bf16 => "bf16",
            ActivationDtype::Mxint8 => "mxint8",
        })
    }
}

/// `v` rounded to the nearest bf16 (ties to even; NaN stays NaN), as its 16 bits.
#[inline(always)]
pub fn round_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 bits.
#[inline(always)]
pub fn bf16_value(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `x` rounded to bf16 into `out` (resized to `x.len()`).
pub fn round_rows(x: &[f32], out: &mut Vec<u16>) {
    out.clear();
    out.extend(x.iter().map(|&v| round_bf16(v)));
}

/// Zero (keeping the sign) for values below f32's normal range.
#[inline(always)]
fn flush(v: f32) -> f32 {
    if v.is_subnormal() {
        0f32.copysign(v)
    } else {
        v
    }
}

/// One term as the instruction adds it: `acc + w * x` with the product exact and one rounding,
/// inputs below the normal range read as zero, and a result whose exact value is below it
/// flushed to zero. (The instruction also flushes some sums that round up to the smallest
/// normal; sums of that size, 1e-38, are outside what the two paths promise to agree on.)
#[inline(always)]
pub fn flushed_term(acc: f32, w: f32, x: f32) -> f32 {
    let (acc, w, x) = (flush(acc), flush(w), flush(x));
    let exact = f64::from(acc) + f64::from(w) * f64::from(x);
    if exact.abs() < f64::from(f32::MIN_POSITIVE) && exact != 0.0 {
        return 0f32.copysign(exact as f32);
    }
    flush(w.mul_add(x, acc))
}

/// `w . x` over elements `[start, end)` (`start` at a block boundary) in the bf16 order,
/// written from its definition: `w` the decoded weights, `x` bf16 inputs.
pub fn bf16_partial(w: &[f32], x: &[u16], start: usize, end: usize) -> f32 {
    let mut acc = [0f32; LANES];
    let mut k0 = start;
    while k0 < end {
        for (l, a) in acc.iter_mut().enumerate() {
            for k in [k0 + 2 * l + 1, k0 + 2 * l] {
                if k < end {
                    *a = flushed_term(*a, w[k], bf16_value(x[k]));
                }
            }
        }
        k0 += BLOCK;
    }
    fold_lanes(acc)
}

/// [`super::block_sums`] in the bf16 order: `w` holds bf16 or MXFP4 blocks, each `x[t]` bf16
/// inputs in element order from the rows' first block (at least `blocks.end` whole blocks).
///
/// # Panics
/// If the format is another, a half block is asked for, or a row or input is too short.
pub fn bf16_block_sums<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    kernel: KernelChoice,
    emit: impl Sink<R, T>,
) {
    assert!(reduction.segment > 0, "segments of no blocks");
    assert!(
        matches!(
            w.format,
            BlockFormat::Bf16 | BlockFormat::Mxfp4 | BlockFormat::Mxfp4RowPairs
        ),
        "the bf16 path reads bf16 or MXFP4 weights"
    );
    assert!(!reduction.half, "the bf16 path sums whole blocks");
    w.check(reduction.blocks.end, false);
    let need = reduction.blocks.end * BLOCK;
    assert!(
        x.iter().all(|x| x.len() >= need),
        "kernel input rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel == KernelChoice::Auto && super::avx512_bf16::available() {
        // SAFETY: the CPU features were just detected; the rows and inputs were checked above
        // to hold every block the kernel reads.
        return unsafe { super::avx512_bf16::block_sums::<R, T>(w, x, reduction, emit) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: as above.
        return unsafe { super::avx2_bf16::block_sums::<R, T>(w, x, reduction, emit) };
    }
    let _ = kernel;
    portable::<R, T>(w, x, reduction, emit)
}

/// Whether [`bf16_block_sums`] under `kernel`, on this CPU, reads one input's bf16 rows in
/// one pass over each register block (the AVX2 path's eight-row sub-blocks), so that a
/// software prefetch ahead of the block is what keeps the stream going; the AVX-512 BF16 path
/// and the portable one read them otherwise.
pub fn bf16_reads_one_input_in_one_pass(kernel: KernelChoice) -> bool {
    #[cfg(target_arch = "x86_64")]
    let avx512 = super::avx512_bf16::available;
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = || false;
    kernel.takes_avx2(avx512)
}

/// The bf16 order one lane at a time (sizes already checked).
fn portable<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    mut emit: impl Sink<R, T>,
) {
    for s in 0..reduction.segments() {
        emit.segment(s, &portable_segment(w, x, reduction, s));
    }
}

/// Segment `s` of [`bf16_block_sums`] one lane at a time (sizes already checked).
pub(super) fn portable_segment<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    s: usize,
) -> [[f32; T]; R] {
    let segment = reduction.segment_blocks(s);
    let mut out = [[0f32; T]; R];
    for (r, out) in out.iter_mut().enumerate() {
        let mut acc = [[0f32; LANES]; T];
        for b in segment.clone() {
            let (even, odd) = w.block(r, b, super::Lanes::Pairs);
            for (acc, x) in acc.iter_mut().zip(x) {
                let xb = &x[b * BLOCK..(b + 1) * BLOCK];
                for l in 0..LANES {
                    let a = flushed_term(acc[l], odd[l], bf16_value(xb[2 * l + 1]));
                    acc[l] = flushed_term(a, even[l], bf16_value(xb[2 * l]));
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            *o = fold_lanes(acc);
        }
    }
    out
}
