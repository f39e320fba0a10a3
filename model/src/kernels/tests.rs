use super::*;
use crate::checkpoint::SharedBytes;
use crate::weights::WeightFormat;
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

fn bf16_matrix(rows: usize, cols: usize, seed: u64) -> (WeightMatrix, Vec<f32>) {
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

fn mxfp4_matrix(rows: usize, cols: usize, seed: u64) -> WeightMatrix {
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
                prop_assert_eq!(single[n], dot(&x[t * cols..(t + 1) * cols], &w[n * cols..(n + 1) * cols]));
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
