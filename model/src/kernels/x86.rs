//! What the x86-64 kernel paths (AVX-512, AVX2) share: the block formats as compile-time
//! constants, where a row's block lies, and the software prefetch ahead of a register block.

use super::block::pair_place;
use super::{BLOCK, BlockRows};
use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};

pub(super) const F32: u8 = 0;
pub(super) const BF16: u8 = 1;
pub(super) const F16: u8 = 2;
pub(super) const MXFP4: u8 = 3;
pub(super) const MXINT8: u8 = 4;
/// [`BlockFormat::Mxfp4RowPairs`] rows whose row 0 is the first of its pair.
pub(super) const MXFP4_PAIRS: u8 = 5;
/// [`BlockFormat::Mxfp4RowPairs`] rows whose row 0 is the second of its pair.
pub(super) const MXFP4_PAIRS_SECOND: u8 = 6;

/// Where row 0 of rows in format `F` sits in its pair (see [`super::block::pair_place`]):
/// `None` for formats not stored in pairs.
const fn pair_offset<const F: u8>() -> Option<usize> {
    match F {
        MXFP4_PAIRS => Some(0),
        MXFP4_PAIRS_SECOND => Some(1),
        _ => None,
    }
}

/// Byte offset of block `b` of row `r` of rows in format `F`: [`BlockRows::data_at`] with the
/// format known when compiling, so the unrolled rows' offsets are constants.
#[inline(always)]
pub(super) fn data_at<const F: u8, const R: usize>(
    w: &BlockRows<'_, R>,
    r: usize,
    b: usize,
) -> usize {
    unit_of::<F>(r) * w.data_strides.row + b * w.data_strides.block
}

/// The storage unit (row, or row pair) that row `r` of rows in format `F` lies in.
#[inline(always)]
pub(super) const fn unit_of<const F: u8>(r: usize) -> usize {
    match pair_offset::<F>() {
        Some(offset) => pair_place(r, offset).0,
        None => r,
    }
}

/// Whether row `r` of rows in format `F` is the second of its pair (its high nibbles).
#[inline(always)]
pub(super) const fn second_of_pair<const F: u8>(r: usize) -> bool {
    match pair_offset::<F>() {
        Some(offset) => pair_place(r, offset).1,
        None => false,
    }
}

/// Data bytes of a block of format `F`.
pub(super) const fn block_bytes<const F: u8>() -> usize {
    match F {
        F32 => BLOCK * 4,
        BF16 | F16 => BLOCK * 2,
        MXFP4 | MXFP4_PAIRS | MXFP4_PAIRS_SECOND => BLOCK / 2,
        _ => BLOCK,
    }
}

/// Asks the cache for the bytes `w.prefetch` ahead of block `b` (`data`: the rows' base), where
/// one run of lines covers this block of every row: block `b`'s run starts `b * steps.0` bytes
/// from the base, its scales' `b * steps.1` (see `BlockRows::prefetch_steps`).
#[inline(always)]
pub(super) fn prefetch<const F: u8, const R: usize>(
    w: &BlockRows<'_, R>,
    data: *const u8,
    scales: *const u8,
    steps: (usize, usize),
    b: usize,
) {
    let bb = block_bytes::<F>();
    // SAFETY: SSE is part of x86-64, and a prefetch never faults, whatever the address.
    let fetch = |p: *const u8| unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    let ahead = b * steps.0 + w.prefetch;
    let mut line = 0;
    while line < R * bb {
        fetch(data.wrapping_add(ahead + line));
        line += 64;
    }
    // The rest of block `b`'s run: where rows lie side by side (the card's groups of 8) a
    // register block of fewer rows still fetches every row's block, so the next register
    // block over the group finds its half in cache instead of reading every other line from
    // memory again (GPT-OSS-20B's bf16 expert at 4 bf16 tokens, one thread: 2.97 against
    // 3.75 ms a call in bench_expert).
    while line < steps.0 {
        fetch(data.wrapping_add(ahead + line));
        line += 64;
    }
    if w.format.has_scales() && b.is_multiple_of(8) {
        fetch(scales.wrapping_add(b * steps.1 + w.prefetch / 16));
    }
}
