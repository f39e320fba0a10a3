//! The card's numerics definition: what every kernel path, every tiling and the software model
//! must compute, bit for bit.
//!
//! A weight row `w` (decoded exactly from its block format) and an input row `x` of length `K`:
//!
//! 1. `K` is cut into **segments** of [`SEGMENT`] = 512 elements from `k = 0` (the last one may be
//!    shorter). Tiles may split `K` only at segment boundaries.
//! 2. Each segment is reduced on its own with 16 f32 lane accumulators, all starting at `+0.0`.
//!    The segment's 32-element **blocks** are visited in order; within block `b` starting at `k0`,
//!    lane `l` first takes element `k0 + 2l`, then element `k0 + 2l + 1` (elements at or past `K`
//!    are skipped), each as `acc[l] = fma(w[k], x[k], acc[l])` (one rounding).
//! 3. The lanes are folded by a fixed halving tree: for width 8, 4, 2, 1: `acc[l] += acc[l + width]`.
//!    `acc[0]` is the segment's partial `q_s`.
//! 4. The output is `((q_0 + q_1) + q_2) + ...` in segment order, then `+ bias` when there is one.
//!
//! This is the [`model::kernels::Paired`] order of the shared kernel layer, cut into segments.
//! Nothing here depends on how rows or segments are spread over tiles, cores, threads or cards, or
//! on the other tokens in the batch, so every such arrangement gives the same bits. Decoded weights
//! are exact (bf16, f16, MXFP4 and MXINT8 values are all representable in f32), so the definition
//! is the dequantized math with this one summation order. Lane pairing (even, odd) matches how
//! MXFP4 nibbles and bf16 pairs sit in memory, which keeps the fast kernels cheap.
//!
//! Where the program marks a matrix's products as rounding their inputs to bf16
//! (`ActivationDtype::Bf16`, bf16 and MXFP4 tiles only), steps 2 and 3 are instead the bf16
//! order of [`model::kernels::bf16_partial`]: each input rounded once to bf16, lane `l` taking
//! element `2l + 1` then `2l` of each block as the AVX-512 BF16 dot-product instruction does
//! ([`dot_bf16`]). Segments and step 4 stay as they are.
//!
//! Where it marks them as quantizing their inputs to MXINT8 (`ActivationDtype::Mxint8`, MXFP4
//! and MXINT8 tiles only), steps 2 and 3 are instead the MXINT8 order of
//! [`model::kernels::mxint8_partial`]: each 32-element block of the input quantized to int8
//! values with a shared power-of-two scale, each block's products summed exactly as integers
//! in 8 lanes of 4 elements, then scaled and added in f32 ([`dot_mxint8`]). This is the card's
//! integer MX arithmetic; segments and step 4 stay as they are.
//!
//! Element-wise steps use the model crate's functions unchanged (`activate`), and combining
//! experts is `out[t] = ((+0.0 + w_0 y_0) + w_1 y_1) + ...` over the token's local slots in slot
//! order, each product rounded before the add, as the reference forward does.

/// Elements per MX block (and per pairing unit of the lanes).
pub const BLOCK: usize = model::kernels::BLOCK;
/// Elements per segment: the unit of splitting the reduction dimension.
pub const SEGMENT: usize = 512;
/// Lane accumulators per segment.
pub const LANES: usize = model::kernels::LANES;
/// Blocks per segment.
pub const BLOCKS_PER_SEGMENT: usize = SEGMENT / BLOCK;

/// Segments of a reduction of length `k`.
pub fn segments(k: usize) -> usize {
    k.div_ceil(SEGMENT)
}

/// `k` rounded up to whole blocks (the stored, zero-padded length).
pub fn padded(k: usize) -> usize {
    k.div_ceil(BLOCK) * BLOCK
}

/// Segment partial `q_s` of `w . x` over elements `[start, end)` (a segment or its tail):
/// steps 2 and 3, the shared kernels' [`model::kernels::Paired`] order.
pub use model::kernels::paired_partial as segment_partial;

/// The canonical dot product of the definition (no bias).
pub fn dot(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: lengths differ");
    let k = w.len();
    let mut y = 0f32;
    for s in 0..segments(k) {
        let q = segment_partial(w, x, s * SEGMENT, ((s + 1) * SEGMENT).min(k));
        y = if s == 0 { q } else { y + q };
    }
    y
}

/// The bf16 order's dot product (no bias): [`dot`] with each segment's partial taken by
/// [`model::kernels::bf16_partial`] over `x` rounded to bf16.
pub fn dot_bf16(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: lengths differ");
    let mut rounded = Vec::new();
    model::kernels::round_rows(x, &mut rounded);
    let k = w.len();
    let mut y = 0f32;
    for s in 0..segments(k) {
        let q = model::kernels::bf16_partial(w, &rounded, s * SEGMENT, ((s + 1) * SEGMENT).min(k));
        y = if s == 0 { q } else { y + q };
    }
    y
}

/// The MXINT8 order's dot product (no bias) of one row stored in an MX block format
/// (`data` and `scales` as the card stores a row, [`crate::format`]) against `x`: [`dot`] with
/// each segment's partial taken by [`model::kernels::mxint8_partial`] over `x` quantized.
pub fn dot_mxint8(
    format: model::kernels::BlockFormat,
    data: &[u8],
    scales: &[u8],
    x: &[f32],
) -> f32 {
    let k = x.len();
    assert!(
        k.is_multiple_of(BLOCK),
        "the MXINT8 order sums whole blocks"
    );
    let integers: Vec<i8> = match format {
        model::kernels::BlockFormat::Mxfp4 => (0..k)
            .map(|i| {
                let nibble = (data[i / 2] >> (4 * (i % 2))) & 0x0f;
                model::kernels::FP4_TIMES_TWO[usize::from(nibble)]
            })
            .collect(),
        model::kernels::BlockFormat::Mxint8 => data[..k].iter().map(|&b| b as i8).collect(),
        other => panic!("the MXINT8 order reads MX weights, not {other:?}"),
    };
    let mut quantized = model::kernels::Mxint8Input::default();
    quantized.quantize(x, 1, k, format);
    let row = quantized.row(0);
    let mut y = 0f32;
    for s in 0..segments(k) {
        let blocks = s * BLOCKS_PER_SEGMENT..((s + 1) * BLOCKS_PER_SEGMENT).min(k / BLOCK);
        let q = model::kernels::mxint8_partial(format, &integers, scales, &row, blocks);
        y = if s == 0 { q } else { y + q };
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_of_small_integers_is_exact() {
        let w: Vec<f32> = (0..1100).map(|i| (i % 7) as f32 - 3.0).collect();
        let x: Vec<f32> = (0..1100).map(|i| (i % 5) as f32 - 2.0).collect();
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert_eq!(dot(&w, &x), exact);
    }

    #[test]
    fn lanes_pair_even_and_odd_elements_then_fold_by_halves() {
        // w[0] = 2^24 swallows the ones added to lane 0 (ulp 2), the other lanes keep theirs:
        // lane 0 = 2^24, lanes 1..15 = 4 each; the halving tree adds 4 + 8 + 16 + 32.
        let mut w = vec![1f32; 64];
        w[0] = 16_777_216.0;
        let x = vec![1f32; 64];
        assert_eq!(dot(&w, &x), 16_777_216.0 + 60.0);
        let sequential = w.iter().fold(0f32, |s, v| s + v);
        assert_eq!(sequential, 16_777_216.0);
    }

    #[test]
    fn segment_counts() {
        assert_eq!(segments(1), 1);
        assert_eq!(segments(512), 1);
        assert_eq!(segments(2880), 6);
        assert_eq!(padded(40), 64);
        assert_eq!(padded(64), 64);
    }
}
