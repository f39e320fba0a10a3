//! The MXINT8 order: quantization, scales and every path against the definition, written
//! here a second time in f64 from the stored values rather than the kernels' integers.

use super::tests::{InterleavedRows, values};
use super::*;
use crate::weights::WeightMatrix;
use proptest::prelude::*;

/// Step 1 of the definition in f64: the shared exponent found by comparing powers of two.
fn quantize_in_f64(x: &[f32]) -> (Vec<i8>, i16) {
    if x.iter().any(|v| !v.is_finite()) {
        return (vec![0; BLOCK], NON_FINITE);
    }
    let amax = x.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
    if amax == 0.0 {
        return (vec![0; BLOCK], MIN_EXPONENT);
    }
    let mut log = -160i32;
    while 2f64.powi(log + 1) <= amax {
        log += 1;
    }
    let e = log - 6;
    let q = x
        .iter()
        .map(|&v| {
            (f64::from(v) / 2f64.powi(e))
                .round_ties_even()
                .clamp(-127.0, 127.0) as i8
        })
        .collect();
    (q, e as i16)
}

/// A block of values spread over `2^-span..2^span` times `base`, signs mixed.
fn spread_block(seed: u64, base: f32, span: i32) -> Vec<f32> {
    values(seed, BLOCK)
        .iter()
        .zip(values(seed + 1, BLOCK))
        .map(|(&v, m)| base * v * 2f32.powi((m * 2.0 * span as f32) as i32))
        .collect()
}

proptest! {
    #[test]
    fn quantization_is_the_definition(seed in 0u64..1_000_000, base_exp in -150i32..120, span in 0i32..30) {
        let x = spread_block(seed, 2f32.powi(base_exp), span);
        let (q, e) = quantize_block(&x);
        let (want_q, want_e) = quantize_in_f64(&x);
        prop_assert_eq!(e, want_e);
        prop_assert_eq!(&q[..], &want_q[..]);
        prop_assert!(e == NON_FINITE || (MIN_EXPONENT..=MAX_EXPONENT).contains(&e));
    }
}

#[test]
fn blocks_of_zeros_subnormals_extremes_and_non_finite_values_quantize_as_defined() {
    let mut cases: Vec<Vec<f32>> = vec![
        vec![0.0; BLOCK],
        vec![-0.0; BLOCK],
        vec![f32::from_bits(1); BLOCK],
        vec![f32::MAX; BLOCK],
        (0..BLOCK).map(|i| f32::from_bits(i as u32 * 977)).collect(),
        (0..BLOCK).map(|i| (i as f32 - 16.0) * 1e30).collect(),
        // Values that round to 128 clamp to 127.
        vec![127.75; BLOCK],
    ];
    let mut nan = vec![1.0; BLOCK];
    nan[7] = f32::NAN;
    let mut inf = vec![1.0; BLOCK];
    inf[31] = f32::NEG_INFINITY;
    cases.extend([nan, inf]);
    for x in &cases {
        let (q, e) = quantize_block(x);
        let (want_q, want_e) = quantize_in_f64(x);
        assert_eq!((&q[..], e), (&want_q[..], want_e), "{x:?}");
    }
    assert_eq!(quantize_block(&cases[6]).0[0], 127);
    assert_eq!(quantize_block(&cases[7]).1, NON_FINITE);
}

#[test]
fn powers_of_two_are_exact_inside_the_range_zero_below_and_infinite_above() {
    for k in -170..140 {
        assert_eq!(
            power_of_two(k).to_bits(),
            (2f64.powi(k) as f32).to_bits(),
            "2^{k}"
        );
    }
    // The scale of an MXFP4 block is 2^(s - 128 + e); an MXINT8 block's 2^(s - 127 + e).
    assert_eq!(block_scale(BlockFormat::Mxfp4, 127, 0), 0.5);
    assert_eq!(block_scale(BlockFormat::Mxint8, 127, 0), 1.0);
    assert_eq!(block_scale(BlockFormat::Mxfp4, 0, MIN_EXPONENT), 0.0);
    assert_eq!(
        block_scale(BlockFormat::Mxint8, 255, MAX_EXPONENT),
        f32::INFINITY
    );
    assert!(block_scale(BlockFormat::Mxfp4, 3, NON_FINITE).is_nan());
}

/// The weight integers of a decoded block value (`n * 2^(s - 127)`, halved for MXFP4).
fn integer_of(format: BlockFormat, value: f32, scale: u8) -> i8 {
    let unit = f64::from(crate::mxfp4::SCALE_LUT[scale as usize])
        / if format == BlockFormat::Mxint8 {
            1.0
        } else {
            2.0
        };
    let n = f64::from(value) / unit;
    assert_eq!(n.fract(), 0.0);
    n as i8
}

/// The definition in f64 from stored values: lane `i` of 8 takes the products of elements
/// `4i..4i + 4` of each block, exactly, then one fused multiply-add by the block's scale.
fn definition(
    format: BlockFormat,
    natural: &[f32],
    scales: &[u8],
    x: &Mxint8Row<'_>,
    blocks: std::ops::Range<usize>,
) -> f32 {
    let mut acc = [0f32; MX_LANES];
    for b in blocks {
        let scale = block_scale(format, scales[b], x.exponents[b]);
        for (l, a) in acc.iter_mut().enumerate() {
            let sum: i64 = (4 * l..4 * l + 4)
                .map(|k| {
                    let n = integer_of(format, natural[b * BLOCK + k], scales[b]);
                    i64::from(n) * i64::from(x.values[b * BLOCK + k])
                })
                .sum();
            *a = (sum as f32).mul_add(scale, *a);
        }
    }
    fold_mx_lanes(acc)
}

/// 3 interleaved rows x 2 inputs of `format` in segments of `segment` blocks: every path's
/// sums against the f64 definition, segment by segment.
fn check_paths(format: BlockFormat, blocks: usize, segment: usize, seed: u64) {
    let stored = InterleavedRows::new(format, false, blocks, seed);
    let x: Vec<f32> = (0..2)
        .flat_map(|t| values(seed + 10 + t, blocks * BLOCK))
        .collect();
    let mut q = Mxint8Input::default();
    q.quantize(&x, 2, blocks * BLOCK, format);
    let w = stored.block_rows();
    let reduction = Reduction {
        segment,
        ..Reduction::whole(0..blocks)
    };
    for kernel in KernelChoice::ALL {
        let mut got = vec![[[0f32; 2]; 3]; reduction.segments()];
        mxint8_block_sums::<3, 2>(
            &w,
            &[q.row(0), q.row(1)],
            &reduction,
            kernel,
            |s: usize, sums: &[[f32; 2]; 3]| got[s] = *sums,
        );
        for (s, got) in got.iter().enumerate() {
            for (r, (natural, _, scales)) in stored.rows.iter().enumerate() {
                for (t, got) in got[r].iter().enumerate() {
                    let want = definition(
                        format,
                        natural,
                        scales,
                        &q.row(t),
                        reduction.segment_blocks(s),
                    );
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{format:?} {kernel:?} segment {s} row {r} input {t}"
                    );
                }
            }
        }
    }
}

#[test]
fn mxint8_order_equals_its_definition_on_every_path() {
    for format in [BlockFormat::Mxfp4, BlockFormat::Mxint8] {
        for (blocks, segment, seed) in [(1, 1, 1), (3, 2, 7), (16, 16, 11), (35, 16, 3)] {
            check_paths(format, blocks, segment, seed);
        }
    }
}

/// One row of MXINT8 weights `n` (scale byte `s` on every block) against `x`, on `kernel`.
fn one_row(n: &[i8], s: u8, x: &[f32], kernel: KernelChoice) -> f32 {
    let blocks = n.len() / BLOCK;
    let data: Vec<u8> = n.iter().map(|&v| v as u8).collect();
    let scales = vec![s; blocks];
    let w = BlockRows::<1>::new(
        BlockFormat::Mxint8,
        &data,
        Strides {
            row: data.len(),
            block: BLOCK,
        },
        &scales,
        Strides { row: 0, block: 1 },
    );
    let mut q = Mxint8Input::default();
    q.quantize(x, 1, x.len(), BlockFormat::Mxint8);
    let mut out = 0f32;
    mxint8_block_sums::<1, 1>(
        &w,
        &[q.row(0)],
        &Reduction::whole(0..blocks),
        kernel,
        |_, s: &[[f32; 1]; 1]| out = s[0][0],
    );
    out
}

#[test]
fn extreme_weights_and_non_finite_inputs_give_the_same_bits_on_every_path() {
    // -128 weights against +-127 inputs: the largest pair sums, no 16-bit overflow.
    let n = vec![-128i8; 2 * BLOCK];
    let x: Vec<f32> = (0..2 * BLOCK)
        .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    let want = -128.0 * x.iter().sum::<f32>();
    let mut nan = x.clone();
    nan[40] = f32::NAN;
    let mut inf = x.clone();
    inf[3] = f32::INFINITY;
    for kernel in KernelChoice::ALL {
        assert_eq!(one_row(&n, 127, &x, kernel), want, "{kernel:?}");
        assert!(one_row(&n, 127, &nan, kernel).is_nan(), "{kernel:?}");
        assert!(one_row(&n, 127, &inf, kernel).is_nan(), "{kernel:?}");
        // A scale byte of 255 overflows to infinity; 0 with a tiny input underflows to zero.
        assert_eq!(
            one_row(&n, 255, &x, kernel),
            f32::NEG_INFINITY,
            "{kernel:?}"
        );
        let tiny: Vec<f32> = x.iter().map(|v| v * 1e-38).collect();
        assert_eq!(one_row(&n, 0, &tiny, kernel), 0.0, "{kernel:?}");
    }
}

/// The MXINT8 sums stay within the quantization's bound of the exact dot product: each input
/// moves by at most half a step, `2^(e - 1)`, and a step is at most `amax / 64`.
#[test]
fn mxint8_sums_are_close_to_the_exact_products() {
    let (rows, cols, tokens) = (29, 256, 3);
    let m = super::tests::mxfp4_matrix(rows, cols, 41).with_activations(ActivationDtype::Mxint8);
    let decoded = m.to_f32();
    let x = values(43, tokens * cols);
    let mut out = vec![0f32; tokens * rows];
    matmul(&x, tokens, &m, None, &mut out);
    let mut worst = 0f64;
    for t in 0..tokens {
        let x = &x[t * cols..(t + 1) * cols];
        for n in 0..rows {
            let w = &decoded[n * cols..(n + 1) * cols];
            let exact: f64 = w
                .iter()
                .zip(x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let mut bound = 1e-6;
            for (wb, xb) in w.chunks(BLOCK).zip(x.chunks(BLOCK)) {
                let amax = xb.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
                bound += wb.iter().map(|v| f64::from(v.abs())).sum::<f64>() * amax / 128.0;
            }
            let err = (f64::from(out[t * rows + n]) - exact).abs();
            assert!(err <= bound, "row {n} token {t}: {err} > {bound}");
            worst = worst.max(err / bound);
        }
    }
    // Not exact either: the quantization is there.
    assert!(worst > 0.0);
}

/// The reference matmul under MXINT8 activations: MXFP4 matrices row by row the definition
/// on the quantized inputs, plus the bias, on every path and for any batch; bf16 matrices
/// take the bf16 order.
#[test]
fn matmul_with_mxint8_activations_is_the_definition_per_row_and_batch_invariant() {
    let (rows, cols, tokens) = (37, 96, 6);
    let m = super::tests::mxfp4_matrix(rows, cols, 6).with_activations(ActivationDtype::Mxint8);
    let decoded = m.to_f32();
    let x = values(9, tokens * cols);
    let bias = values(13, rows);
    let mut q = Mxint8Input::default();
    q.quantize(&x, tokens, cols, BlockFormat::Mxfp4);
    let mut outs = Vec::new();
    for kernel in KernelChoice::ALL {
        let mut out = vec![0f32; tokens * rows];
        matmul_with(&x, tokens, &m, Some(&bias), &mut out, kernel);
        for t in 0..tokens {
            for n in 0..rows {
                let row_scales = m.row_scales(n);
                let want = definition(
                    BlockFormat::Mxfp4,
                    &decoded[n * cols..(n + 1) * cols],
                    row_scales,
                    &q.row(t),
                    0..cols / BLOCK,
                ) + bias[n];
                assert_eq!(out[t * rows + n].to_bits(), want.to_bits(), "{kernel:?}");
            }
        }
        outs.push(out);
    }
    let mut one = vec![0f32; rows];
    matmul(&x[cols..2 * cols], 1, &m, Some(&bias), &mut one);
    assert_eq!(one, outs[0][rows..2 * rows]);
    // bf16 weights under the same setting: the bf16 order.
    let b = super::tests::bf16_matrix(rows, cols, 5).0;
    let (mut as_mx, mut as_bf16) = (vec![0f32; tokens * rows], vec![0f32; tokens * rows]);
    matmul(
        &x,
        tokens,
        &b.clone().with_activations(ActivationDtype::Mxint8),
        None,
        &mut as_mx,
    );
    matmul(
        &x,
        tokens,
        &b.with_activations(ActivationDtype::Bf16),
        None,
        &mut as_bf16,
    );
    assert_eq!(as_mx, as_bf16);
}

#[test]
fn matvecs_quantize_an_input_once_per_format_and_give_each_product_its_matmul() {
    let (rows, cols) = (37, 96);
    let mx = super::tests::mxfp4_matrix(rows, cols, 22).with_activations(ActivationDtype::Mxint8);
    let bf = super::tests::bf16_matrix(rows, cols, 21)
        .0
        .with_activations(ActivationDtype::Mxint8);
    let a = values(31, cols);
    let products: [(&[f32], &WeightMatrix); 3] = [(&a, &mx), (&a, &bf), (&a, &mx)];
    let mut together = vec![vec![0f32; rows]; products.len()];
    let jobs = products
        .iter()
        .zip(together.iter_mut())
        .map(|(&(x, w), out)| MatVec {
            x,
            w,
            bias: None,
            out,
        })
        .collect();
    matvecs(jobs);
    for (i, &(x, w)) in products.iter().enumerate() {
        let mut alone = vec![0f32; rows];
        matmul(x, 1, w, None, &mut alone);
        assert_eq!(together[i], alone, "product {i}");
    }
}

#[test]
fn the_setting_picks_each_formats_numerics() {
    use ActivationDtype::*;
    assert_eq!("mxint8".parse::<ActivationDtype>(), Ok(Mxint8));
    assert_eq!(Mxint8.to_string(), "mxint8");
    for (setting, format, cols, want) in [
        (Mxint8, BlockFormat::Mxfp4, 64, Mxint8),
        (Mxint8, BlockFormat::Mxfp4RowPairs, 64, Mxint8),
        (Mxint8, BlockFormat::Mxint8, 64, Mxint8),
        (Mxint8, BlockFormat::Bf16, 64, Bf16),
        (Mxint8, BlockFormat::F32, 64, F32),
        (Mxint8, BlockFormat::Mxfp4, 40, F32),
        (Bf16, BlockFormat::Mxint8, 64, F32),
        (Bf16, BlockFormat::Mxfp4, 64, Bf16),
        (F32, BlockFormat::Mxfp4, 64, F32),
    ] {
        assert_eq!(setting.numerics(format, cols), want, "{setting} {format:?}");
    }
}
