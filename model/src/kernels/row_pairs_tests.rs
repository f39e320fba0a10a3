//! [`BlockFormat::Mxfp4RowPairs`]: rows stored two to a pair block give, on every path, order
//! and register block, the bits of the same rows stored one by one as MXFP4.

use super::tests::{random_blocks, values};
use super::*;

/// Rows per group, as the card's tiles group them.
const GROUP: usize = 8;

/// `GROUP` rows of `blocks` random MXFP4 blocks, stored both ways with the card's interleaving
/// (block 0 of every row, then block 1, ...): (standard data, pair data, scales).
fn stored(blocks: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let rows: Vec<_> = (0..GROUP as u64)
        .map(|r| random_blocks(BlockFormat::Mxfp4, false, blocks, seed + r))
        .collect();
    let mut standard = vec![0u8; GROUP * blocks * 16];
    let mut pairs = vec![0u8; GROUP * blocks * 16];
    let mut scales = vec![0u8; GROUP * blocks];
    for (r, (_, data, s)) in rows.iter().enumerate() {
        for b in 0..blocks {
            let block = &data[b * 16..(b + 1) * 16];
            standard[(b * GROUP + r) * 16..][..16].copy_from_slice(block);
            scales[b * GROUP + r] = s[b];
            for k in 0..BLOCK {
                let nibble = (block[k / 2] >> (4 * (k % 2))) & 0x0f;
                pairs[b * GROUP * 16 + r / 2 * 32 + k] |= nibble << (4 * (r % 2));
            }
        }
    }
    (standard, pairs, scales)
}

/// Rows `r0..r0 + R` of a group, standard and as row pairs.
fn rows<'a, const R: usize>(
    (standard, pairs, scales): &'a (Vec<u8>, Vec<u8>, Vec<u8>),
    r0: usize,
) -> (BlockRows<'a, R>, BlockRows<'a, R>) {
    let block = GROUP * 16;
    let scale_strides = Strides {
        row: 1,
        block: GROUP,
    };
    let one = BlockRows::<R>::new(
        BlockFormat::Mxfp4,
        &standard[r0 * 16..],
        Strides { row: 16, block },
        &scales[r0..],
        scale_strides,
    );
    let two = BlockRows::<R>::new(
        BlockFormat::Mxfp4RowPairs,
        &pairs[r0 / 2 * 32..],
        Strides { row: 32, block },
        &scales[r0..],
        scale_strides,
    );
    (
        one,
        if r0 % 2 == 1 {
            two.from_second_of_pair()
        } else {
            two
        },
    )
}

/// Every order and path over rows `r0..r0 + R` against `T` inputs: the pair layout's bits
/// against the standard layout's.
fn check<const R: usize, const T: usize>(blocks: usize, r0: usize, seed: u64) {
    let data = stored(blocks, seed);
    let (one, two) = rows::<R>(&data, r0);
    let x: Vec<Vec<f32>> = (0..T as u64)
        .map(|t| values(seed + 100 + t, blocks * BLOCK))
        .collect();
    let xb: Vec<Vec<u16>> = x
        .iter()
        .map(|x| {
            let mut b = Vec::new();
            round_rows(x, &mut b);
            b
        })
        .collect();
    let xs: [&[f32]; T] = std::array::from_fn(|t| &x[t][..]);
    let mut q = Mxint8Input::default();
    q.quantize(&x.concat(), T, blocks * BLOCK, BlockFormat::Mxfp4);
    let xq: [Mxint8Row<'_>; T] = std::array::from_fn(|t| q.row(t));
    let xbs: [&[u16]; T] = std::array::from_fn(|t| &xb[t][..]);
    let reduction = Reduction {
        segment: 3,
        ..Reduction::whole(0..blocks)
    };
    for kernel in KernelChoice::ALL {
        let run = |w: &BlockRows<'_, R>, which: u8| {
            let mut got: Vec<u32> = Vec::new();
            let mut push =
                |_: usize, s: &[[f32; T]; R]| got.extend(s.iter().flatten().map(|v| v.to_bits()));
            match which {
                0 => block_sums::<Paired, R, T>(w, &xs, &reduction, kernel, &mut push),
                1 => block_sums::<Strided, R, T>(w, &xs, &reduction, kernel, &mut push),
                2 => bf16_block_sums::<R, T>(w, &xbs, &reduction, kernel, &mut push),
                _ => mxint8_block_sums::<R, T>(w, &xq, &reduction, kernel, &mut push),
            }
            got
        };
        for which in 0..4 {
            let want = run(&one, which);
            assert_eq!(want.len(), R * T * blocks.div_ceil(3));
            assert_eq!(
                run(&two, which),
                want,
                "{R}x{T} rows from {r0}, order {which}, {kernel:?}"
            );
        }
    }
}

#[test]
fn row_pairs_give_the_bits_of_the_same_rows_stored_one_by_one() {
    // 22 blocks: 8 segments of 3, more than the MXINT8 path takes a sub-block through at once.
    for (blocks, seed) in [(1, 1), (4, 7), (7, 13), (22, 19)] {
        check::<8, 1>(blocks, 0, seed);
        check::<8, 2>(blocks, 0, seed);
        check::<4, 4>(blocks, 4, seed);
        check::<3, 1>(blocks, 1, seed);
        check::<3, 4>(blocks, 5, seed);
        check::<2, 2>(blocks, 2, seed);
        check::<1, 1>(blocks, 7, seed);
        check::<1, 3>(blocks, 6, seed);
        check::<8, 5>(blocks, 0, seed);
    }
}

#[test]
fn a_pair_block_decodes_each_row_in_element_order() {
    let data = stored(2, 5);
    let (one, two) = rows::<2>(&data, 2);
    for r in 0..2 {
        for b in 0..2 {
            for lanes in [Lanes::Halves, Lanes::Pairs] {
                assert_eq!(
                    one.block(r, b, lanes),
                    two.block(r, b, lanes),
                    "row {r} block {b}"
                );
            }
        }
    }
    assert!(two.second_of_pair(1) && !two.second_of_pair(0));
}

/// Inputs that are rows of one quantization (evenly spaced: the offset path reaches them all
/// from the first) and the same inputs quantized one by one (the general path) give the same
/// bits, on every path, for row pairs against 2 to 4 inputs.
#[test]
fn mxint8_inputs_quantized_together_or_apart_give_the_same_bits() {
    const T: usize = 4;
    let blocks = 5;
    let data = stored(blocks, 41);
    let (_, two) = rows::<GROUP>(&data, 0);
    let x: Vec<Vec<f32>> = (0..T as u64)
        .map(|t| values(300 + t, blocks * BLOCK))
        .collect();
    let mut together = Mxint8Input::default();
    together.quantize(&x.concat(), T, blocks * BLOCK, BlockFormat::Mxfp4);
    let apart: Vec<Mxint8Input> = x
        .iter()
        .map(|x| {
            let mut q = Mxint8Input::default();
            q.quantize(x, 1, blocks * BLOCK, BlockFormat::Mxfp4);
            q
        })
        .collect();
    let reduction = Reduction {
        segment: 2,
        ..Reduction::whole(0..blocks)
    };
    for kernel in KernelChoice::ALL {
        let run = |xq: [Mxint8Row<'_>; T]| {
            let mut got: Vec<u32> = Vec::new();
            mxint8_block_sums::<GROUP, T>(
                &two,
                &xq,
                &reduction,
                kernel,
                |_: usize, s: &[[f32; T]; GROUP]| {
                    got.extend(s.iter().flatten().map(|v| v.to_bits()))
                },
            );
            got
        };
        let want = run(std::array::from_fn(|t| together.row(t)));
        assert_eq!(want.len(), GROUP * T * blocks.div_ceil(2));
        assert_eq!(
            run(std::array::from_fn(|t| apart[t].row(0))),
            want,
            "{kernel:?}"
        );
    }
}

/// The offset path's test for inputs it can reach from the first: rows of one quantization in
/// order, whole or viewed from a later block, are `blocks` apart; rows out of order are not
/// taken for evenly spaced.
#[cfg(target_arch = "x86_64")]
#[test]
fn rows_of_one_quantization_are_found_evenly_spaced_from_any_block() {
    use super::avx2_mxint8::spacing;
    let blocks = 6;
    let mut q = Mxint8Input::default();
    q.quantize(
        &values(7, 3 * blocks * BLOCK),
        3,
        blocks * BLOCK,
        BlockFormat::Mxfp4,
    );
    assert_eq!(spacing(&[q.row(0), q.row(1), q.row(2)]), Some(blocks));
    assert_eq!(
        spacing(&[q.row(1).from_block(2), q.row(2).from_block(2)]),
        Some(blocks)
    );
    assert_eq!(spacing(&[q.row(2)]), Some(0));
    assert_eq!(spacing(&[q.row(1), q.row(0)]), None);
    assert_eq!(spacing(&[q.row(0), q.row(2), q.row(1)]), None);
    // Views from different blocks are evenly spaced too, one block further apart: block b of
    // the second is still `step + b` blocks past the first's start in every array.
    assert_eq!(
        spacing(&[q.row(0), q.row(1).from_block(1)]),
        Some(blocks + 1)
    );
}

/// Row pairs spaced otherwise than in the cards' tiles (padding after each pair block and
/// each scale byte), which the offset path leaves to the general one, give the bits of the
/// same rows stored one by one, against 1, 2 and 4 inputs of one quantization.
#[test]
fn row_pairs_spaced_otherwise_than_tiles_give_the_same_bits() {
    let blocks = 5;
    let data = stored(blocks, 23);
    let (_, pairs, scales) = &data;
    let (one, two) = rows::<GROUP>(&data, 0);
    // Each pair block 64 bytes apart instead of 32, each scale byte 2 apart instead of 1.
    let mut spaced = vec![0u8; 2 * pairs.len()];
    for (i, chunk) in pairs.chunks(32).enumerate() {
        spaced[i * 64..i * 64 + 32].copy_from_slice(chunk);
    }
    let mut spaced_scales = vec![0u8; 2 * scales.len()];
    for (i, &s) in scales.iter().enumerate() {
        spaced_scales[2 * i] = s;
    }
    let wide = BlockRows::<GROUP>::new(
        BlockFormat::Mxfp4RowPairs,
        &spaced,
        Strides {
            row: 64,
            block: GROUP * 32,
        },
        &spaced_scales,
        Strides {
            row: 2,
            block: 2 * GROUP,
        },
    );
    #[cfg(target_arch = "x86_64")]
    {
        use super::avx2_mxint8::packed;
        assert!(packed(&two) && !packed(&wide));
    }
    fn sums<const T: usize>(
        w: &BlockRows<'_, GROUP>,
        blocks: usize,
        kernel: KernelChoice,
    ) -> Vec<u32> {
        let mut q = Mxint8Input::default();
        q.quantize(
            &values(31, T * blocks * BLOCK),
            T,
            blocks * BLOCK,
            BlockFormat::Mxfp4,
        );
        let xq: [Mxint8Row<'_>; T] = std::array::from_fn(|t| q.row(t));
        let reduction = Reduction {
            segment: 2,
            ..Reduction::whole(0..blocks)
        };
        let mut got = Vec::new();
        mxint8_block_sums::<GROUP, T>(
            w,
            &xq,
            &reduction,
            kernel,
            |_: usize, s: &[[f32; T]; GROUP]| got.extend(s.iter().flatten().map(|v| v.to_bits())),
        );
        got
    }
    for kernel in KernelChoice::ALL {
        for (want, got) in [
            (
                sums::<1>(&one, blocks, kernel),
                sums::<1>(&wide, blocks, kernel),
            ),
            (
                sums::<2>(&one, blocks, kernel),
                sums::<2>(&wide, blocks, kernel),
            ),
            (
                sums::<4>(&one, blocks, kernel),
                sums::<4>(&wide, blocks, kernel),
            ),
        ] {
            assert!(!want.is_empty());
            assert_eq!(got, want, "{kernel:?}");
        }
        assert_eq!(
            sums::<2>(&two, blocks, kernel),
            sums::<2>(&one, blocks, kernel),
            "{kernel:?}"
        );
    }
}
