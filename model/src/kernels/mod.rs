//! The CPU numerics kernel layer of afd: lane folds, block decode of every weight format (f32,
//! bf16, f16, MXFP4, MXINT8) and the register-blocked matrix kernel, shared by the reference
//! forward ([`matmul`]) and the Corsair card executor (`corsair_ffn::executor`, over its own tile
//! storage). Both read weights in their stored format and decode 32 values at a time in
//! registers; nothing is expanded to f32 in memory.
//!
//! The two callers add a dot product's terms in different orders, and each order is part of a
//! contract (the reference's batch invariance and `dot` equality, the card's bit-exactness
//! against its software model), so the order is a type parameter ([`SumOrder`]):
//!
//! - [`Strided`], the reference forward's: lane `l` of 16 f32 lanes takes every element
//!   `k = l mod 16` of the row, as a separate multiply and add (two roundings); the lanes are
//!   folded by [`fold_lanes`]; the elements past the last whole 16 are then added one by one.
//! - [`Paired`], the card's (`corsair_ffn::numerics`): within each 32-element block lane `l`
//!   takes element `2l`, then `2l + 1`, as fused multiply-adds, folded per segment.
//!
//! Neither depends on the number of tokens, the register blocking, the thread count or the
//! instruction set, so every kernel path gives the same bits as the plain definitions
//! ([`dot`] and [`paired_partial`]).
//!
//! A third order, opt-in, rounds the inputs to bf16 and adds pairs of products as the CPU's
//! AVX-512 BF16 instruction does ([`ActivationDtype::Bf16`], [`bf16_partial`],
//! [`bf16_block_sums`]). A fourth quantizes the inputs to MXINT8 and sums each block's
//! products exactly in integers, as a Corsair card and llama.cpp's MXFP4 path do
//! ([`ActivationDtype::Mxint8`], [`mxint8_partial`], [`mxint8_block_sums`]). Both callers use
//! them where a matrix says so ([`crate::WeightMatrix::activations`], the card's program), and
//! they too give the same bits on every path.
//!
//! A block's 32 values reach the 16 lanes as two vectors ([`Lanes`]): the first and second
//! half of the stored block, or its even and odd elements. [`Paired`] deinterleaves bf16, f16
//! and MXFP4 (a 32-bit word or a byte already holds a pair, so that is a shift or a mask) and
//! expects f32 and MXINT8 blocks stored even elements first, which the card's tile packing does.

mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_bf16;
#[cfg(target_arch = "x86_64")]
mod avx2_bf16_rows;
#[cfg(target_arch = "x86_64")]
mod avx2_mxint8;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_bf16;
mod bf16;
mod block;
mod matmul;
mod mxint8;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use activation::activate;
pub use bf16::{
    ActivationDtype, bf16_block_sums, bf16_partial, bf16_reads_one_input_in_one_pass, bf16_value,
    flushed_term, round_bf16, round_rows,
};
pub use block::{BlockFormat, BlockRows, Lanes, Strides, decode_block, decode_value};
pub use matmul::{MatVec, matmul, matmul_with, matvecs};
pub use mxint8::{
    FP4_TIMES_TWO, MAX_EXPONENT, MIN_EXPONENT, MX_LANES, Mxint8Input, Mxint8Row, NON_FINITE,
    block_scale, fold_mx_lanes, mxint8_block_sums, mxint8_partial, power_of_two, quantize_block,
};

/// Lanes of the fixed-order sums (one AVX-512 register of f32).
pub const LANES: usize = 16;
/// Elements per block: the unit the kernels decode and the card's MX formats scale.
pub const BLOCK: usize = 32;

/// Which implementation runs a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelChoice {
    /// The widest this CPU supports: AVX-512 (with BF16 for the bf16 order), else AVX2 with
    /// FMA and F16C, else the portable path.
    #[default]
    Auto,
    /// The AVX2 path even where AVX-512 is there (tests and comparisons); the portable path
    /// where the CPU lacks AVX2, FMA or F16C.
    Avx2,
    /// Plain Rust (same bits, slower).
    Portable,
}

impl KernelChoice {
    /// Every choice, for tests that check that all paths agree.
    pub const ALL: [KernelChoice; 3] = [
        KernelChoice::Auto,
        KernelChoice::Avx2,
        KernelChoice::Portable,
    ];

    /// Whether this choice lets the AVX2 path run where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    fn avx2(self) -> bool {
        self != KernelChoice::Portable && avx2::available()
    }

    /// Whether a kernel under this choice takes the AVX2 path, where `avx512` says whether
    /// the CPU has the AVX-512 features the kernel's wider path needs (`Auto` takes that one).
    fn takes_avx2(self, avx512: impl FnOnce() -> bool) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            !(self == KernelChoice::Auto && avx512()) && self.avx2()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = avx512;
            false
        }
    }
}

/// The kernel paths this CPU cannot run, by name (empty where it runs them all). Tests that
/// go through [`KernelChoice::ALL`] check every path the CPU has (`Auto` is the AVX-512 one
/// where there is one) and pass here without checking these: they report them as skipped.
pub fn paths_this_cpu_lacks() -> Vec<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        [
            (avx512::available(), "AVX-512 (F, BW, FMA, F16C)"),
            (avx512_bf16::available(), "AVX-512 BF16"),
            (avx2::available(), "AVX2 (with FMA and F16C)"),
        ]
        .into_iter()
        .filter(|(has, _)| !has)
        .map(|(_, name)| name)
        .collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        vec![
            "AVX-512 (F, BW, FMA, F16C)",
            "AVX-512 BF16",
            "AVX2 (with FMA and F16C)",
        ]
    }
}

/// A fixed summation order of the matrix kernel (see the module documentation).
pub trait SumOrder: Copy + Send + Sync + 'static {
    /// Each term is one fused multiply-add (one rounding) rather than a multiply and an add.
    const FUSED: bool;
    /// Lane `l` takes elements `2l` and `2l + 1` of each block (else `l` and `16 + l`).
    const PAIRED: bool;

    /// How blocks of `format` reach the lanes in this order.
    fn lanes(format: BlockFormat) -> Lanes {
        lanes_of(Self::PAIRED, format)
    }

    /// One term added to a lane.
    #[inline(always)]
    fn add_term(acc: f32, w: f32, x: f32) -> f32 {
        if Self::FUSED {
            w.mul_add(x, acc)
        } else {
            acc + w * x
        }
    }
}

/// Lane layout of `format` under an order (`paired` or not): the paired order deinterleaves
/// the formats that store pairs together and reads f32 and MXINT8 as stored even-first.
pub const fn lanes_of(paired: bool, format: BlockFormat) -> Lanes {
    match (paired, format) {
        (
            true,
            BlockFormat::Bf16 | BlockFormat::F16 | BlockFormat::Mxfp4 | BlockFormat::Mxfp4RowPairs,
        ) => Lanes::Pairs,
        _ => Lanes::Halves,
    }
}

/// The reference forward's order: 16 strided lanes over the whole row, multiply then add.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strided;

impl SumOrder for Strided {
    const FUSED: bool = false;
    const PAIRED: bool = false;
}

/// The card's order: lanes take (even, odd) pairs of each block, fused multiply-adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paired;

impl SumOrder for Paired {
    const FUSED: bool = true;
    const PAIRED: bool = true;
}

/// The fixed halving tree over 16 lane sums: for widths 8, 4, 2, 1, `acc[l] += acc[l + width]`;
/// `acc[0]` is the result. Every kernel path folds its registers by this tree.
#[inline(always)]
pub fn fold_lanes(acc: [f32; LANES]) -> f32 {
    halving_fold(acc)
}

/// The halving tree over any power-of-two number of lanes (see [`fold_lanes`]).
#[inline(always)]
pub(crate) fn halving_fold<const N: usize>(mut acc: [f32; N]) -> f32 {
    let mut width = N / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `a . b` in the [`Strided`] order: the definition every reference kernel path reproduces.
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
            acc[l] = Strided::add_term(acc[l], cb[l], ca[l]);
        }
    }
    let mut tail = 0f32;
    for i in full..a.len() {
        tail += a[i] * b[i];
    }
    fold_lanes(acc) + tail
}

/// `w . x` over elements `[start, end)` in the [`Paired`] order, written from its definition:
/// 16 lanes from `+0.0`; the 32-element blocks from `start` in order; in each, lane `l` takes
/// element `2l` then `2l + 1` (those at or past `end` skipped) with a fused multiply-add; the
/// lanes folded by [`fold_lanes`]. The card sums these partials segment by segment.
pub fn paired_partial(w: &[f32], x: &[f32], start: usize, end: usize) -> f32 {
    let mut acc = [0f32; LANES];
    let mut k0 = start;
    while k0 < end {
        for half in 0..2 {
            for (l, a) in acc.iter_mut().enumerate() {
                let k = k0 + 2 * l + half;
                if k < end {
                    *a = Paired::add_term(*a, w[k], x[k]);
                }
            }
        }
        k0 += BLOCK;
    }
    fold_lanes(acc)
}

/// Calls [`BlockJob::run`] over a grid of `rows` x `tokens` in register blocks: with one token,
/// 8 rows at a time (8 independent accumulators keep the multiply-add units busy), else 4 rows
/// x up to 4 tokens. Blocks of 8 rows start at multiples of 8 and blocks of fewer rows at
/// multiples of 4, so a block never straddles an aligned group of 8 rows.
pub fn register_blocks(rows: usize, tokens: usize, job: &mut impl BlockJob) {
    if tokens == 0 {
        return;
    }
    if tokens == 1 {
        let mut r = 0;
        while r + 8 <= rows {
            job.run::<8, 1>(r, 0);
            r += 8;
        }
        while r < rows {
            job.run::<1, 1>(r, 0);
            r += 1;
        }
        return;
    }
    let mut r = 0;
    while r < rows {
        let rr = (rows - r).min(4);
        let mut t = 0;
        while t < tokens {
            let tt = (tokens - t).min(4);
            match (rr, tt) {
                (4, 4) => job.run::<4, 4>(r, t),
                (4, 3) => job.run::<4, 3>(r, t),
                (4, 2) => job.run::<4, 2>(r, t),
                (4, 1) => job.run::<4, 1>(r, t),
                (3, 4) => job.run::<3, 4>(r, t),
                (2, 4) => job.run::<2, 4>(r, t),
                (1, 4) => job.run::<1, 4>(r, t),
                (3, _) => job.run::<3, 1>(r, t),
                (2, _) => job.run::<2, 1>(r, t),
                _ => job.run::<1, 1>(r, t),
            }
            t += if rr < 4 && tt < 4 { 1 } else { tt };
        }
        r += rr;
    }
}

/// Register blocks of rows `r..r + R` against every token, up to 4 tokens at a time: for kernels
/// that read their inputs from memory rather than registers, where a wide block of rows shares
/// each input's preparation (the reference matmul's bf16 products, the card's MXINT8 tiles).
pub fn token_quads<const R: usize>(r: usize, tokens: usize, job: &mut impl BlockJob) {
    let mut t = 0;
    while t < tokens {
        match tokens - t {
            1 => job.run::<R, 1>(r, t),
            2 => job.run::<R, 2>(r, t),
            3 => job.run::<R, 3>(r, t),
            _ => job.run::<R, 4>(r, t),
        }
        t += (tokens - t).min(4);
    }
}

/// Work on one register block of a grid (see [`register_blocks`]).
pub trait BlockJob {
    /// Rows `r0..r0 + R`, tokens `t0..t0 + T`.
    fn run<const R: usize, const T: usize>(&mut self, r0: usize, t0: usize);
}

/// The part of the reduction dimension one kernel call sums: blocks `blocks`, cut from its
/// start into segments of `segment` blocks that are each folded on their own (the card's 512-
/// element segments; `usize::MAX` for one segment), and with `half` the first 16 values of
/// block `blocks.end` added into the last segment before its fold (the [`Strided`] order's last
/// 16 of a row; dense formats in [`Lanes::Halves`] only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reduction {
    /// Whole blocks summed.
    pub blocks: std::ops::Range<usize>,
    /// Blocks per folded segment.
    pub segment: usize,
    /// Whether the first half of block `blocks.end` is added too.
    pub half: bool,
}

impl Reduction {
    /// Blocks `blocks` as one segment, without a half block.
    pub fn whole(blocks: std::ops::Range<usize>) -> Self {
        Reduction {
            blocks,
            segment: usize::MAX,
            half: false,
        }
    }

    /// Segments the reduction has (at least one: an empty one folds to `+0.0`).
    pub fn segments(&self) -> usize {
        self.blocks.len().div_ceil(self.segment).max(1)
    }

    /// The blocks of segment `s`.
    #[inline(always)]
    pub fn segment_blocks(&self, s: usize) -> std::ops::Range<usize> {
        let first = self.blocks.start + s * self.segment;
        first..first.saturating_add(self.segment).min(self.blocks.end)
    }
}

/// Where [`block_sums`] hands each segment's sums: any `FnMut(segment, &sums)`, or a type whose
/// method the compiler is told to inline into the kernel's loop (a closure call there can cost
/// more than the segment's fold).
pub trait Sink<const R: usize, const T: usize> {
    /// Segment `s`'s sums: `sums[r][t]` of row `r` against input `t`.
    fn segment(&mut self, s: usize, sums: &[[f32; T]; R]);
}

impl<const R: usize, const T: usize, F: FnMut(usize, &[[f32; T]; R])> Sink<R, T> for F {
    #[inline(always)]
    fn segment(&mut self, s: usize, sums: &[[f32; T]; R]) {
        self(s, sums)
    }
}

/// Whether [`block_sums`] under `kernel`, on this CPU, reads one input's bf16 rows in one pass
/// over each register block (the AVX2 path's eight-row sub-blocks, where AVX-512 is not
/// taken), so that a software prefetch ahead of the block is what keeps the stream going.
pub fn block_sums_read_one_input_in_one_pass(kernel: KernelChoice) -> bool {
    #[cfg(target_arch = "x86_64")]
    let avx512 = avx512::available;
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = || false;
    kernel.takes_avx2(avx512)
}

/// Folded sums of `R` weight rows against `T` input rows in `order`, on the path `kernel`
/// picks: for each segment `s` of `reduction`, `emit.segment(s, sums)` with `sums[r][t]` the
/// segment's sum of row `r` of `w` against `x[t]`.
///
/// Each `x[t]` starts at the rows' first block (element 0 of block 0) and holds at least
/// `blocks.end` whole blocks (plus 16 values with `half`); inputs of the [`Paired`] order are
/// pair-ordered the way [`Lanes`] says.
///
/// # Panics
/// If a row or input is too short for the reduction, or `half` is asked of a format or order
/// that has none.
pub fn block_sums<O: SumOrder, const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[f32]; T],
    reduction: &Reduction,
    kernel: KernelChoice,
    emit: impl Sink<R, T>,
) {
    let Reduction {
        blocks,
        segment,
        half,
    } = reduction;
    assert!(*segment > 0, "segments of no blocks");
    let lanes = O::lanes(w.format);
    assert!(
        !half || (lanes == Lanes::Halves && !w.format.has_scales()),
        "a half block is only for dense formats in halves"
    );
    w.check(blocks.end, *half);
    let need = blocks.end * BLOCK + if *half { LANES } else { 0 };
    assert!(
        x.iter().all(|x| x.len() >= need),
        "kernel input rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel == KernelChoice::Auto && avx512::available() {
        // SAFETY: the CPU features were just detected; the rows and inputs were checked above
        // to hold every block (and half block) the kernel reads.
        return unsafe { avx512::block_sums::<O, R, T>(w, x, reduction, emit) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: as above.
        return unsafe { avx2::block_sums::<O, R, T>(w, x, reduction, emit) };
    }
    let _ = kernel;
    portable::block_sums::<O, R, T>(w, x, reduction, emit)
}

/// Asks the cache for the first `limit` bytes of `bytes` at once (a stream's start, which the
/// prefetch inside the kernel does not cover); nothing where the CPU has no such hint.
pub fn prefetch_start(bytes: &[u8], limit: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut line = 0;
        while line < limit.min(bytes.len()) {
            // SAFETY: SSE is part of x86-64; a prefetch never faults, and the address is inside
            // `bytes` anyway.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    bytes[line..].as_ptr().cast(),
                )
            };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, limit);
}

#[cfg(test)]
mod bf16_tests;
#[cfg(test)]
mod mxint8_tests;
#[cfg(test)]
mod row_pairs_tests;
#[cfg(test)]
pub(crate) mod tests;
