use super::*;
use crate::checkpoint::SharedBytes;
use crate::weights::{WeightFormat, WeightMatrix};
use proptest::prelude::*;

fn naive(x: &[f32], tokens: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; tokens * rows];
    for t in 0..tokens {
        for n in 0..rows {
            let mut s = 0f64;
            for k in 0..cols {
                s += x[t * cols + k] as f64 * w[n * cols + k] as f64;
            }
            out[t * rows + n] = s as f32;
        }
    }
    out
}

/// A deterministic pseudo-random vector in [-0.5, 0.5) (also used by other modules' tests).
pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

pub(crate) fn bf16_matrix(rows: usize, cols: usize, seed: u64) -> (WeightMatrix, Vec<f32>) {
    let w: Vec<f32> = values(seed, rows * cols)
        .into_iter()
        .map(|v| half::bf16::from_f32(v).to_f32())
        .collect();
    let bytes: Vec<u8> = w
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    (
        WeightMatrix::from_bytes(WeightFormat::Bf16, rows, cols, SharedBytes::from_vec(bytes)),
        w,
    )
}

pub(crate) fn mxfp4_matrix(rows: usize, cols: usize, seed: u64) -> WeightMatrix {
    let raw = values(seed, rows * cols);
    let mut blocks = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / 32];
    for r in 0..rows {
        crate::mxfp4::quantize_row(
            &raw[r * cols..(r + 1) * cols],
            &mut blocks[r * cols / 2..(r + 1) * cols / 2],
            &mut scales[r * cols / 32..(r + 1) * cols / 32],
        );
    }
    WeightMatrix::mxfp4(
        rows,
        cols,
        SharedBytes::from_vec(blocks),
        SharedBytes::from_vec(scales),
    )
}

proptest! {
    #[test]
    fn matches_f64_reference_and_is_batch_invariant(
        tokens in 1usize..11, rows in 1usize..70, cols in 1usize..100, seed in 0u64..1000,
    ) {
        let x = values(seed, tokens * cols);
        let w = values(seed + 1, rows * cols);
        let m = WeightMatrix::from_f32(rows, cols, &w);
        let mut out = vec![0f32; tokens * rows];
        matmul(&x, tokens, &m, None, &mut out);
        let reference = naive(&x, tokens, &w, rows, cols);
        for (a, b) in out.iter().zip(&reference) {
            prop_assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()));
        }
        for t in 0..tokens {
            // Each token alone gives the same bits as in the batch, and as `dot`.
            let mut single = vec![0f32; rows];
            matmul(&x[t * cols..(t + 1) * cols], 1, &m, None, &mut single);
            prop_assert_eq!(&single[..], &out[t * rows..(t + 1) * rows]);
            for n in 0..rows {
                let (input, row) = (&x[t * cols..(t + 1) * cols], &w[n * cols..(n + 1) * cols]);
                prop_assert_eq!(single[n], dot(input, row));
            }
        }
    }

    #[test]
    fn every_format_equals_dot_on_the_decoded_rows(
        tokens in 1usize..7, rows in 1usize..40, blocks in 1usize..5, seed in 0u64..1000,
    ) {
        let cols = blocks * 32;
        let x = values(seed, tokens * cols);
        let (bf, _) = bf16_matrix(rows, cols, seed + 3);
        for m in [bf, mxfp4_matrix(rows, cols, seed + 5)] {
            let decoded = m.to_f32();
            let mut out = vec![0f32; tokens * rows];
            matmul(&x, tokens, &m, None, &mut out);
            for t in 0..tokens {
                for n in 0..rows {
                    prop_assert_eq!(
                        out[t * rows + n],
                        dot(&x[t * cols..(t + 1) * cols], &decoded[n * cols..(n + 1) * cols])
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_and_strided_rows() {
    let (rows, cols) = (6, 40);
    let (m, w) = bf16_matrix(rows, cols, 3);
    let odd = m.select_rows(1, 2, 3);
    let x = values(9, cols);
    let mut out = vec![0f32; 3];
    matmul(&x, 1, &odd, Some(&[1.0, 2.0, 3.0]), &mut out);
    for (i, o) in out.iter().enumerate() {
        let r = 1 + 2 * i;
        let expect = dot(&x, &w[r * cols..(r + 1) * cols]) + (i + 1) as f32;
        assert_eq!(*o, expect);
    }
}

/// Natural-order values of `blocks` random blocks of `format`, and their stored bytes and
/// scales as the order `paired` reads them (f32 and MXINT8 even elements first when paired).
pub(crate) fn random_blocks(
    format: BlockFormat,
    paired: bool,
    blocks: usize,
    seed: u64,
) -> (Vec<f32>, Vec<u8>, Vec<u8>) {
    let raw = values(seed, blocks * BLOCK);
    let scales: Vec<u8> = (0..blocks).map(|b| 120 + (b as u8 * 3) % 9).collect();
    let mut natural = vec![0f32; blocks * BLOCK];
    let mut data = vec![0u8; blocks * format.block_bytes()];
    let even_first = paired && lanes_of(true, format) == Lanes::Halves;
    for b in 0..blocks {
        let bytes = &mut data[b * format.block_bytes()..(b + 1) * format.block_bytes()];
        let scale = crate::mxfp4::SCALE_LUT[scales[b] as usize];
        // Stored position of natural element i.
        let at = |i: usize| {
            if even_first {
                i / 2 + (i % 2) * LANES
            } else {
                i
            }
        };
        for i in 0..BLOCK {
            let v = raw[b * BLOCK + i] * 8.0;
            let (value, j) = (&mut natural[b * BLOCK + i], at(i));
            match format {
                BlockFormat::F32 => {
                    *value = v;
                    bytes[4 * j..4 * j + 4].copy_from_slice(&v.to_le_bytes());
                }
                BlockFormat::Bf16 => {
                    let h = half::bf16::from_f32(v);
                    *value = h.to_f32();
                    bytes[2 * j..2 * j + 2].copy_from_slice(&h.to_le_bytes());
                }
                BlockFormat::F16 => {
                    let h = half::f16::from_f32(v);
                    *value = h.to_f32();
                    bytes[2 * j..2 * j + 2].copy_from_slice(&h.to_le_bytes());
                }
                BlockFormat::Mxfp4 => {
                    let nibble = (v.to_bits() >> 7) as u8 & 0x0f;
                    *value = crate::mxfp4::FP4_VALUES[nibble as usize] * scale;
                    bytes[j / 2] |= nibble << (4 * (j % 2));
                }
                BlockFormat::Mxint8 => {
                    let q = (v * 15.0) as i8;
                    *value = q as f32 * scale;
                    bytes[j] = q as u8;
                }
                BlockFormat::Mxfp4RowPairs => unreachable!("row pairs are built from MXFP4 rows"),
            }
        }
    }
    (natural, data, scales)
}

/// `x` pair-ordered within each block (the paired order's inputs).
fn pair_ordered(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (b, block) in out.chunks_exact_mut(BLOCK).enumerate() {
        for l in 0..LANES {
            block[l] = x[b * BLOCK + 2 * l];
            block[LANES + l] = x[b * BLOCK + 2 * l + 1];
        }
    }
    out
}

const FORMATS: [BlockFormat; 5] = [
    BlockFormat::F32,
    BlockFormat::Bf16,
    BlockFormat::F16,
    BlockFormat::Mxfp4,
    BlockFormat::Mxint8,
];

/// Rows of random blocks ([`random_blocks`]) stored interleaved block by block, the card's
/// tile layout (so the kernels' strides are exercised).
pub(crate) struct InterleavedRows {
    /// Each row's natural-order values, stored bytes and scales.
    pub rows: Vec<(Vec<f32>, Vec<u8>, Vec<u8>)>,
    format: BlockFormat,
    data: Vec<u8>,
    scales: Vec<u8>,
}

impl InterleavedRows {
    /// Three rows.
    pub(crate) fn new(format: BlockFormat, paired: bool, blocks: usize, seed: u64) -> Self {
        Self::with_rows(3, format, paired, blocks, seed)
    }

    /// `n` rows.
    pub(crate) fn with_rows(
        n: usize,
        format: BlockFormat,
        paired: bool,
        blocks: usize,
        seed: u64,
    ) -> Self {
        let rows: Vec<_> = (0..n as u64)
            .map(|r| random_blocks(format, paired, blocks, seed + r))
            .collect();
        let bb = format.block_bytes();
        let mut data = vec![0u8; n * blocks * bb];
        let mut scales = vec![0u8; n * blocks];
        for (r, (_, d, s)) in rows.iter().enumerate() {
            for b in 0..blocks {
                data[(b * n + r) * bb..(b * n + r + 1) * bb]
                    .copy_from_slice(&d[b * bb..(b + 1) * bb]);
                scales[b * n + r] = s[b];
            }
        }
        InterleavedRows {
            rows,
            format,
            data,
            scales,
        }
    }

    /// The same rows one after another, each whole (a row-major matrix), as the kernels take
    /// them: their bytes and scales, which the view borrows.
    pub(crate) fn row_major(&self) -> (Vec<u8>, Vec<u8>) {
        let data = self.rows.iter().flat_map(|(_, d, _)| d.clone()).collect();
        let scales = self.rows.iter().flat_map(|(_, _, s)| s.clone()).collect();
        (data, scales)
    }

    /// A view of [`Self::row_major`]'s bytes and scales.
    pub(crate) fn row_major_rows<'a, const R: usize>(
        &self,
        (data, scales): &'a (Vec<u8>, Vec<u8>),
    ) -> BlockRows<'a, R> {
        assert_eq!(R, self.rows.len(), "a view of every row made");
        let (bb, row_bytes) = (self.format.block_bytes(), data.len() / self.rows.len());
        BlockRows::<R>::new(
            self.format,
            data,
            Strides {
                row: row_bytes,
                block: bb,
            },
            scales,
            Strides {
                row: row_bytes / bb,
                block: 1,
            },
        )
    }

    /// The rows as the kernels take them (`R`: how many were made).
    pub(crate) fn block_rows<const R: usize>(&self) -> BlockRows<'_, R> {
        assert_eq!(R, self.rows.len(), "a view of every row made");
        let bb = self.format.block_bytes();
        BlockRows::<R>::new(
            self.format,
            &self.data,
            Strides {
                row: bb,
                block: R * bb,
            },
            &self.scales,
            Strides { row: 1, block: R },
        )
    }
}

/// `R` rows x `T` inputs over `blocks` blocks in the paired order, rows interleaved block by
/// block: each path's sums against [`paired_partial`] of the natural-order values.
fn check_paired<const R: usize, const T: usize>(format: BlockFormat, blocks: usize, seed: u64) {
    let stored = InterleavedRows::with_rows(R, format, true, blocks, seed);
    let rows = &stored.rows;
    let x: Vec<Vec<f32>> = (0..T as u64)
        .map(|t| values(seed + 10 + t, blocks * BLOCK))
        .collect();
    let xp: Vec<Vec<f32>> = x.iter().map(|x| pair_ordered(x)).collect();
    let w = stored.block_rows::<R>();
    for kernel in KernelChoice::ALL {
        let mut got = [[0f32; T]; R];
        let whole = Reduction::whole(0..blocks);
        block_sums::<Paired, R, T>(
            &w,
            &std::array::from_fn(|t| xp[t].as_slice()),
            &whole,
            kernel,
            |_, s: &[[f32; T]; R]| got = *s,
        );
        for (r, (natural, _, _)) in rows.iter().enumerate() {
            for (t, x) in x.iter().enumerate() {
                let want = paired_partial(natural, x, 0, blocks * BLOCK);
                assert_eq!(
                    got[r][t].to_bits(),
                    want.to_bits(),
                    "{format:?} {kernel:?} {R} rows, row {r} input {t}"
                );
            }
        }
    }
}

#[test]
fn paired_order_equals_its_definition_on_both_paths_for_every_format() {
    for format in FORMATS {
        for (blocks, seed) in [(1, 1), (3, 7), (16, 11)] {
            check_paired::<3, 2>(format, blocks, seed);
            // A card's group of 8 rows against one input (the AVX2 path's eight-row sub-block
            // for bf16 rows), and 7 rows (sub-blocks of 4, 2 and 1).
            check_paired::<8, 1>(format, blocks, seed);
            check_paired::<7, 1>(format, blocks, seed);
        }
    }
}

#[test]
fn strided_order_equals_dot_on_both_paths_for_every_format() {
    for format in FORMATS {
        let blocks = 5;
        let (natural, data, scales) = random_blocks(format, false, blocks, 3);
        let x = values(4, blocks * BLOCK);
        let strides = |block| Strides { row: 0, block };
        let w = BlockRows::<1>::new(
            format,
            &data,
            strides(format.block_bytes()),
            &scales,
            strides(1),
        );
        for kernel in KernelChoice::ALL {
            let mut got = [[0f32; 1]; 1];
            let whole = Reduction::whole(0..blocks);
            block_sums::<Strided, 1, 1>(&w, &[&x], &whole, kernel, |_, s: &[[f32; 1]; 1]| got = *s);
            assert_eq!(
                got[0][0].to_bits(),
                dot(&natural, &x).to_bits(),
                "{format:?}"
            );
        }
    }
}

#[test]
fn decoded_lanes_are_the_stored_halves_or_pairs() {
    let (natural, data, scales) = random_blocks(BlockFormat::Mxfp4, false, 1, 5);
    let (a, b) = decode_block(BlockFormat::Mxfp4, Lanes::Halves, &data, scales[0]);
    assert_eq!(&a[..], &natural[..16]);
    assert_eq!(&b[..], &natural[16..]);
    let (a, b) = decode_block(BlockFormat::Mxfp4, Lanes::Pairs, &data, scales[0]);
    for l in 0..LANES {
        assert_eq!((a[l], b[l]), (natural[2 * l], natural[2 * l + 1]));
    }
}

#[test]
fn both_paths_agree_across_register_blocks_and_strided_matrices() {
    for (rows, cols, tokens) in [(13, 70, 1), (9, 64, 5), (21, 200, 9), (8, 16, 3)] {
        for m in [
            bf16_matrix(rows * 2, cols, 9).0.select_rows(1, 2, rows),
            WeightMatrix::from_f32(rows, cols, &values(2, rows * cols)),
        ] {
            let x = values(5, tokens * cols);
            let product = |kernel| {
                let mut out = vec![0f32; tokens * rows];
                matmul_with(&x, tokens, &m, None, &mut out, kernel);
                out.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
            };
            let want = product(KernelChoice::Portable);
            for kernel in [KernelChoice::Auto, KernelChoice::Avx2] {
                assert_eq!(
                    product(kernel),
                    want,
                    "{kernel:?} {rows}x{cols}, {tokens} tokens"
                );
            }
        }
    }
}

#[test]
fn lane_fold_is_the_halving_tree() {
    // Lane 0 = 2^24 (ulp 2) swallows the 1 of lane 8 (a tie, to even), then takes lanes 4, 2
    // and 1 as 2, 4 and 8 (sums of 2, 4 and 8 ones): 2^24 + 14. Another tree gives another sum.
    let mut acc = [1f32; LANES];
    acc[0] = 16_777_216.0;
    assert_eq!(fold_lanes(acc), 16_777_216.0 + 14.0);
    let sequential = acc.iter().fold(0f32, |s, v| s + v);
    assert_eq!(sequential, 16_777_216.0);
}

#[test]
fn segments_are_folded_on_their_own_in_order() {
    let (natural, data, scales) = random_blocks(BlockFormat::Bf16, true, 5, 8);
    let x = values(6, 5 * BLOCK);
    let xp = pair_ordered(&x);
    let strides = |block| Strides { row: 0, block };
    let w = BlockRows::<1>::new(BlockFormat::Bf16, &data, strides(64), &scales, strides(1));
    let reduction = Reduction {
        segment: 2,
        ..Reduction::whole(0..5)
    };
    assert_eq!(reduction.segments(), 3);
    for kernel in KernelChoice::ALL {
        let mut got = Vec::new();
        block_sums::<Paired, 1, 1>(&w, &[&xp], &reduction, kernel, |s, v: &[[f32; 1]; 1]| {
            got.push((s, v[0][0]))
        });
        let want: Vec<(usize, f32)> = (0..3)
            .map(|s| {
                let end = (2 * s + 2).min(5) * BLOCK;
                (s, paired_partial(&natural, &x, 2 * s * BLOCK, end))
            })
            .collect();
        assert_eq!(got, want, "{kernel:?}");
    }
}

/// The tests that run [`KernelChoice::ALL`] check the paths this CPU has; those it lacks are
/// reported as not run rather than passed in silence. `Auto` takes the widest path present.
#[test]
fn the_kernel_paths_this_cpu_lacks_are_reported() {
    let lacking = paths_this_cpu_lacks();
    for path in &lacking {
        test_skips::skipped(&format!(
            "the {path} kernel path was not run: this CPU lacks it (CI's machines may too)"
        ));
    }
    #[cfg(target_arch = "x86_64")]
    {
        let has = |name: &str| !lacking.iter().any(|p| p.starts_with(name));
        assert_eq!(
            KernelChoice::Auto.takes_avx2(avx512::available),
            !has("AVX-512 (") && has("AVX2"),
            "{lacking:?}"
        );
        assert_eq!(
            KernelChoice::Avx2.takes_avx2(avx512::available),
            has("AVX2"),
            "{lacking:?}"
        );
    }
}
