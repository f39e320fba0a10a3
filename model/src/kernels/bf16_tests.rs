use super::tests::{InterleavedRows, values};
use super::*;
use crate::weights::WeightMatrix;
use proptest::prelude::*;

/// `R` rows x `T` inputs of `format` over `blocks` blocks, rows interleaved block by block
/// (the card's tile layout) and then one after another (a row-major matrix), in segments of
/// `segment` blocks: each path's sums against [`bf16_partial`] of the decoded values and the
/// rounded inputs, segment by segment.
fn check_bf16<const R: usize, const T: usize>(
    format: BlockFormat,
    blocks: usize,
    segment: usize,
    seed: u64,
) {
    let stored = InterleavedRows::with_rows(R, format, false, blocks, seed);
    let row_major = stored.row_major();
    let rows = &stored.rows;
    let x: [Vec<u16>; T] = std::array::from_fn(|t| {
        let mut xb = Vec::new();
        round_rows(&values(seed + 10 + t as u64, blocks * BLOCK), &mut xb);
        xb
    });
    let reduction = Reduction {
        segment,
        ..Reduction::whole(0..blocks)
    };
    for (layout, w) in [
        ("tile", stored.block_rows::<R>()),
        ("row-major", stored.row_major_rows::<R>(&row_major)),
    ] {
        for kernel in KernelChoice::ALL {
            let mut got = vec![[[0f32; T]; R]; reduction.segments()];
            bf16_block_sums::<R, T>(
                &w,
                &std::array::from_fn(|t| x[t].as_slice()),
                &reduction,
                kernel,
                |s: usize, sums: &[[f32; T]; R]| got[s] = *sums,
            );
            for (s, got) in got.iter().enumerate() {
                let (start, end) = (s * segment * BLOCK, ((s + 1) * segment).min(blocks) * BLOCK);
                for (r, (natural, _, _)) in rows.iter().enumerate() {
                    for (t, x) in x.iter().enumerate() {
                        let want = bf16_partial(natural, x, start, end);
                        assert_eq!(
                            got[r][t].to_bits(),
                            want.to_bits(),
                            "{format:?} {layout} {kernel:?} segment {s} row {r} input {t}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_order_equals_its_definition_on_both_paths() {
    for format in [BlockFormat::Bf16, BlockFormat::Mxfp4] {
        // Segments of more than 16 blocks: the AVX2 path carries its sums across input chunks.
        for (blocks, segment, seed) in [
            (1, 1, 1),
            (3, 2, 7),
            (16, 16, 11),
            (35, 16, 3),
            (40, 40, 5),
            (45, 20, 9),
        ] {
            check_bf16::<3, 2>(format, blocks, segment, seed);
            // A card's group of 8 rows against one input: the AVX2 path's eight-row
            // sub-block for bf16 rows.
            check_bf16::<8, 1>(format, blocks, segment, seed);
            // Fewer rows than a group: the sub-block takes what fits of 4, 2 and 1 rows.
            check_bf16::<7, 1>(format, blocks, segment, seed);
            // Two to four inputs: bf16 rows in turn against all of them (AVX2); row-major,
            // in chunks of rows against all of them, a row ahead prefetched past the last.
            check_bf16::<8, 2>(format, blocks, segment, seed);
            check_bf16::<8, 4>(format, blocks, segment, seed);
            check_bf16::<5, 3>(format, blocks, segment, seed);
            check_bf16::<32, 4>(format, blocks, segment, seed);
        }
    }
    // More segments than the AVX2 path's rows in turn keep: the chunked path takes the tile
    // layout's (row-major rows take row chunks at any number of segments).
    check_bf16::<8, 4>(BlockFormat::Bf16, 40, 1, 13);
}

/// Whole blocks of bf16 bits `w` against bf16 bits `x` on the path `kernel` picks.
fn blocks(w: &[u16], x: &[u16], kernel: KernelChoice) -> f32 {
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let rows = BlockRows::<1>::new(
        BlockFormat::Bf16,
        &bytes,
        Strides { row: 64, block: 64 },
        &[],
        Strides { row: 0, block: 0 },
    );
    let mut got = 0f32;
    bf16_block_sums::<1, 1>(
        &rows,
        &[x],
        &Reduction::whole(0..w.len() / BLOCK),
        kernel,
        |_, s: &[[f32; 1]; 1]| got = s[0][0],
    );
    got
}

/// A card's group of 8 rows side by side (one block each), or the same 8 rows of a row-major
/// matrix (`row_major`), against 4 inputs: `w` and `x` hold the 8 rows' and the 4 inputs' 32
/// values, one after another; each sum on the path `kernel` picks.
fn group_sums(w: &[u16], x: &[u16], row_major: bool, kernel: KernelChoice) -> [[f32; 4]; 8] {
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    // One block a row: the same bytes either way, read with the layout's strides.
    let block = if row_major { 64 } else { 8 * 64 };
    let rows = BlockRows::<8>::new(
        BlockFormat::Bf16,
        &bytes,
        Strides { row: 64, block },
        &[],
        Strides { row: 0, block: 0 },
    );
    let mut got = [[0f32; 4]; 8];
    bf16_block_sums::<8, 4>(
        &rows,
        &std::array::from_fn(|t| &x[t * BLOCK..]),
        &Reduction::whole(0..1),
        kernel,
        |_, s: &[[f32; 4]; 8]| got = *s,
    );
    got
}

/// A bf16 value `m * 2^e` with a 7-bit mantissa `m` in `[-127, 127]`.
fn bf16_of(m: i32, e: i32) -> u16 {
    round_bf16(m as f32 * 2f32.powi(e))
}

proptest! {
    #[test]
    fn the_instruction_adds_as_the_definition_says(
        w in prop::array::uniform32((-127i32..128, -30i32..30)),
        x in prop::array::uniform32((-127i32..128, -30i32..30)),
    ) {
        // Products differ in size by up to 2^120, so each lane's odd-then-even order and its
        // one rounding per product show in the bits.
        let w: [u16; 32] = w.map(|(m, e)| bf16_of(m, e));
        let x: [u16; 32] = x.map(|(m, e)| bf16_of(m, e));
        let values: Vec<f32> = w.iter().map(|&b| bf16_value(b)).collect();
        let want = bf16_partial(&values, &x, 0, 32);
        for kernel in KernelChoice::ALL {
            prop_assert_eq!(blocks(&w, &x, kernel).to_bits(), want.to_bits());
        }
    }
}

proptest! {
    #[test]
    fn sums_near_the_bottom_of_the_normal_range_flush_as_the_definition_says(
        base in -72i32..-40,
        w in prop::array::uniform32((-127i32..128, 0i32..10)),
        x in prop::array::uniform32((-127i32..128, 0i32..10)),
        cancel in prop::array::uniform16(any::<bool>()),
    ) {
        // Products from 2^(2 base) to 2^(2 base + 34): near the bottom of the range some lanes
        // fall below it and are flushed (the AVX2 path computes such segments again lane by
        // lane); from a base of about -50 on, its plain multiply-adds give the bits. Lanes
        // that cancel their first product leave tiny differences.
        let mut w: [u16; 32] = w.map(|(m, e)| bf16_of(m, base + e));
        let x: [u16; 32] = x.map(|(m, e)| bf16_of(m, base + e));
        for (l, &c) in cancel.iter().enumerate() {
            if c && bf16_value(x[2 * l]) != 0.0 {
                let odd = bf16_value(w[2 * l + 1]) * bf16_value(x[2 * l + 1]);
                w[2 * l] = round_bf16(-odd / bf16_value(x[2 * l]));
            }
        }
        let values: Vec<f32> = w.iter().map(|&b| bf16_value(b)).collect();
        let want = bf16_partial(&values, &x, 0, 32);
        for kernel in KernelChoice::ALL {
            prop_assert_eq!(blocks(&w, &x, kernel).to_bits(), want.to_bits(), "{:?}", kernel);
        }
        // The same block as one row of a card's group against four inputs (the AVX2 path's
        // rows in turn), or of a row-major matrix's (its row chunks), the other rows and inputs
        // scaled copies.
        let scaled = |v: &[u16; 32], k: i32| -> Vec<u16> {
            v.iter().map(|&b| round_bf16(bf16_value(b) * 2f32.powi(k))).collect()
        };
        let group: Vec<u16> = (0..8).flat_map(|r| scaled(&w, r % 3)).collect();
        let inputs: Vec<u16> = (0..4).flat_map(|t| scaled(&x, t % 2)).collect();
        let layouts = KernelChoice::ALL.into_iter().flat_map(|k| [(k, false), (k, true)]);
        for (kernel, row_major) in layouts {
            let got = group_sums(&group, &inputs, row_major, kernel);
            for (r, got) in got.iter().enumerate() {
                let row: Vec<f32> = group[r * 32..][..32].iter().map(|&b| bf16_value(b)).collect();
                for (t, got) in got.iter().enumerate() {
                    let want = bf16_partial(&row, &inputs[t * 32..][..32], 0, 32);
                    prop_assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{:?} row-major {} row {} input {}",
                        kernel,
                        row_major,
                        r,
                        t
                    );
                }
            }
        }
    }
}

#[test]
fn a_lane_adds_its_odd_element_first_with_one_rounding_each() {
    // Lane 0 holds 1 from block 0, then block 1's odd product -1 and even product 2^-24.
    // Odd first: 1 - 1 = 0, then + 2^-24 = 2^-24. Even first would give 1 + 2^-24 = 1 (a tie,
    // to even), then - 1 = 0.
    let mut w = [0u16; 64];
    let mut x = [0u16; 64];
    let one = round_bf16(1.0);
    (w[0], x[0]) = (one, one);
    (w[33], x[33]) = (round_bf16(-1.0), one);
    (w[32], x[32]) = (round_bf16(2f32.powi(-12)), round_bf16(2f32.powi(-12)));
    let values: Vec<f32> = w.iter().map(|&b| bf16_value(b)).collect();
    let want = bf16_partial(&values, &x, 0, 64);
    assert_eq!(want, 2f32.powi(-24));
    for kernel in KernelChoice::ALL {
        assert_eq!(
            blocks(&w, &x, kernel).to_bits(),
            want.to_bits(),
            "{kernel:?}"
        );
    }
}

#[test]
fn inputs_and_results_below_the_normal_range_are_zero() {
    let tiny = f32::MIN_POSITIVE / 4.0;
    assert_eq!(flushed_term(0.0, tiny, 1.0), 0.0);
    assert_eq!(flushed_term(tiny, 1.0, 0.0), 0.0);
    // 2^-70 * 2^-70 is far below the normal range: flushed, not kept as a subnormal.
    assert_eq!(flushed_term(0.0, 2f32.powi(-70), 2f32.powi(-70)), 0.0);
    assert_eq!(flushed_term(1.0, 2.0, 3.0), 7.0);
    let mut w = [0u16; 32];
    let mut x = [0u16; 32];
    w[0] = round_bf16(tiny);
    x[0] = round_bf16(1.0);
    w[2] = round_bf16(2f32.powi(-70));
    x[2] = round_bf16(2f32.powi(-70));
    w[5] = round_bf16(3.0);
    x[5] = round_bf16(0.5);
    for kernel in KernelChoice::ALL {
        assert_eq!(blocks(&w, &x, kernel), 1.5, "{kernel:?}");
    }
}

#[test]
fn rounding_to_bf16_is_to_nearest_even() {
    assert_eq!(round_bf16(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
    assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
    // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even 1 + 2^-6.
    assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    assert_eq!(round_bf16(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3f81);
    assert!(bf16_value(round_bf16(f32::NAN)).is_nan());
    assert_eq!(bf16_value(round_bf16(f32::INFINITY)), f32::INFINITY);
    assert_eq!(round_bf16(-0.0), 0x8000);
}

#[test]
fn activation_dtypes_parse_and_print() {
    for (text, dtype) in [
        ("f32", ActivationDtype::F32),
        ("bf16", ActivationDtype::Bf16),
        ("bfloat16", ActivationDtype::Bf16),
    ] {
        assert_eq!(text.parse::<ActivationDtype>(), Ok(dtype));
    }
    assert_eq!(ActivationDtype::Bf16.to_string(), "bf16");
    let err = "fp8".parse::<ActivationDtype>().unwrap_err();
    assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
    assert!(!ActivationDtype::F32.rounds(BlockFormat::Bf16, 64));
    assert!(ActivationDtype::Bf16.rounds(BlockFormat::Mxfp4, 64));
    assert!(!ActivationDtype::Bf16.rounds(BlockFormat::Bf16, 40));
    assert!(!ActivationDtype::Bf16.rounds(BlockFormat::F32, 64));
}

/// The reference matmul of bf16 and MXFP4 matrices under bf16 activations: row by row the
/// definition over the rounded inputs, plus the bias; the same bits on both paths and for any
/// batch (batch invariance).
#[test]
fn matmul_with_bf16_activations_is_the_definition_per_row_and_batch_invariant() {
    // 37 rows: one whole task of 32 (the wide register blocks) and 5 more; 1,280 columns: rows
    // longer than the AVX2 path's input chunks. 6, 11 and 13 tokens: the task's register
    // blocks of 6 and 5 tokens, and the 1 or 4 left after them.
    for cols in [96, 1280] {
        for tokens in [6, 11, 13] {
            check_bf16_matmul(37, cols, tokens);
        }
    }
}

/// A bf16 matrix's smallest nonzero weight is found once, for every view of its bytes, and the
/// products that take it in place of watching each block still give the definition's bits: a
/// weight below the plain range anywhere in the matrix sends them to the exact path. (A row
/// whose only nonzero weight is a subnormal one is where the plain multiply-adds would differ:
/// they keep a subnormal product the definition flushes to zero.)
#[test]
fn a_bf16_matrix_knows_its_smallest_weight_and_its_products_stay_exact() {
    let (rows, cols) = (37, 1280);
    let (m, w) = super::tests::bf16_matrix(rows, cols, 21);
    let want = w
        .iter()
        .filter(|v| **v != 0.0)
        .map(|v| u32::from(half::bf16::from_f32(*v).to_bits() & 0x7fff) >> 7)
        .min();
    assert_eq!(m.smallest_exponent(), Some(want));
    assert_eq!(
        m.select_rows(3, 2, 5).smallest_exponent(),
        m.smallest_exponent()
    );
    let zeros = WeightMatrix::from_bytes(
        crate::weights::WeightFormat::Bf16,
        2,
        64,
        crate::checkpoint::SharedBytes::from_vec(vec![0; 2 * 64 * 2]),
    );
    assert_eq!(zeros.smallest_exponent(), Some(None));
    assert_eq!(
        super::tests::mxfp4_matrix(2, 64, 3).smallest_exponent(),
        None
    );
    // The last row all zero but one weight: a subnormal one, then 2^-100 (normal, but too
    // small against these inputs for the plain range).
    for tiny in [0x0003u16, round_bf16(2f32.powi(-100))] {
        let mut bits: Vec<u16> = w.iter().map(|v| round_bf16(*v)).collect();
        bits[(rows - 1) * cols..].fill(0);
        bits[(rows - 1) * cols + 7] = tiny;
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let m = WeightMatrix::from_bytes(
            crate::weights::WeightFormat::Bf16,
            rows,
            cols,
            crate::checkpoint::SharedBytes::from_vec(bytes),
        )
        .with_activations(ActivationDtype::Bf16);
        assert_eq!(m.smallest_exponent(), Some(Some(u32::from(tiny >> 7))));
        let decoded = m.to_f32();
        for tokens in [1, 4, 6] {
            let x = values(40 + tokens as u64, tokens * cols);
            let mut xb = Vec::new();
            round_rows(&x, &mut xb);
            for kernel in KernelChoice::ALL {
                let mut out = vec![0f32; tokens * rows];
                matmul_with(&x, tokens, &m, None, &mut out, kernel);
                let what = format!("{tiny:#06x} {kernel:?} {tokens} tokens");
                assert_definition(&out, &decoded, &xb, None, (rows, cols, tokens), &what);
            }
        }
    }
}

/// Asserts that `out` (`[tokens, rows]`, from `matmul_with` under `kernel`) holds, bit for bit,
/// each row of `decoded` against each rounded input row of `xb` in the bf16 order, plus the bias
/// (or `+0.0`).
fn assert_definition(
    out: &[f32],
    decoded: &[f32],
    xb: &[u16],
    bias: Option<&[f32]>,
    (rows, cols, tokens): (usize, usize, usize),
    what: &str,
) {
    for t in 0..tokens {
        for n in 0..rows {
            let want = bf16_partial(
                &decoded[n * cols..(n + 1) * cols],
                &xb[t * cols..(t + 1) * cols],
                0,
                cols,
            ) + bias.map_or(0.0, |b| b[n]);
            assert_eq!(
                out[t * rows + n].to_bits(),
                want.to_bits(),
                "{what}: token {t} row {n}"
            );
        }
    }
}

fn check_bf16_matmul(rows: usize, cols: usize, tokens: usize) {
    let bf16 = super::tests::bf16_matrix(rows, cols, 5).0;
    let mxfp4 = super::tests::mxfp4_matrix(rows, cols, 6);
    let x = values(9, tokens * cols);
    let bias = values(13, rows);
    for m in [bf16, mxfp4] {
        let m: WeightMatrix = m.with_activations(ActivationDtype::Bf16);
        let decoded = m.to_f32();
        let mut xb = Vec::new();
        round_rows(&x, &mut xb);
        let mut outs = Vec::new();
        for kernel in KernelChoice::ALL {
            let mut out = vec![0f32; tokens * rows];
            matmul_with(&x, tokens, &m, Some(&bias), &mut out, kernel);
            let what = format!("{kernel:?}");
            assert_definition(
                &out,
                &decoded,
                &xb,
                Some(&bias),
                (rows, cols, tokens),
                &what,
            );
            outs.push(out);
        }
        let mut one = vec![0f32; rows];
        matmul_with(
            &x[cols..2 * cols],
            1,
            &m,
            Some(&bias),
            &mut one,
            KernelChoice::Auto,
        );
        assert_eq!(one, outs[0][rows..2 * rows]);
        // The default keeps the exact f32 order.
        let exact = m.clone().with_activations(ActivationDtype::F32);
        let mut out = vec![0f32; tokens * rows];
        matmul_with(
            &x,
            tokens,
            &exact,
            Some(&bias),
            &mut out,
            KernelChoice::Auto,
        );
        assert_ne!(out, outs[0]);
    }
}

/// Products run together by `matvecs` (two on one input, one on another, rounded and exact
/// matrices mixed) each give the bits `matmul` gives them alone: an input rounded once for
/// several products is the input each of them rounds.
#[test]
fn matvecs_on_shared_and_separate_inputs_give_each_product_its_matmul() {
    let (rows, cols) = (37, 96);
    let rounded = [
        super::tests::bf16_matrix(rows, cols, 21).0,
        super::tests::mxfp4_matrix(rows, cols, 22),
    ]
    .map(|m| m.with_activations(ActivationDtype::Bf16));
    let exact = super::tests::bf16_matrix(rows, cols, 23).0;
    let (a, b) = (values(31, cols), values(32, cols));
    let bias = values(33, rows);
    // (input, matrix, bias) of each product; the exact one shares input `a` too.
    type Product<'a> = (&'a [f32], &'a WeightMatrix, Option<&'a [f32]>);
    let products: [Product<'_>; 4] = [
        (&a, &rounded[0], Some(&bias)),
        (&a, &rounded[1], None),
        (&b, &rounded[0], None),
        (&a, &exact, Some(&bias)),
    ];
    let mut together = vec![vec![0f32; rows]; products.len()];
    let jobs = products
        .iter()
        .zip(together.iter_mut())
        .map(|(&(x, w, bias), out)| MatVec { x, w, bias, out })
        .collect();
    matvecs(jobs);
    for (i, &(x, w, bias)) in products.iter().enumerate() {
        let mut alone = vec![0f32; rows];
        matmul(x, 1, w, bias, &mut alone);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&together[i]), bits(&alone), "product {i}");
    }
}
