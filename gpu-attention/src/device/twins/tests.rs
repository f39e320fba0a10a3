use super::*;
use crate::device::kernel_constants::LIN_WARPS;
use crate::device::tests::values;

/// Row `r` of MXFP4 `blocks`/`scales` (`k` elements) by the model's own decoder: the reference
/// the twins' decoding is checked against.
fn mxfp4_row(blocks: &[u8], scales: &[u8], k: usize, r: usize, out: &mut [f32]) {
    model::mxfp4::decode_row(
        &blocks[r * k / 2..(r + 1) * k / 2],
        &scales[r * k / 32..(r + 1) * k / 32],
        model::mxfp4::scale_table(),
        out,
    );
}

/// Bytes from a seed, every scale within a few powers of two of 1.
fn bytes(n: usize, seed: u64, scales: bool) -> Vec<u8> {
    values(n, seed)
        .into_iter()
        .map(|v| {
            let b = ((v + 1.0) * 128.0) as u8;
            if scales { 124 + b % 6 } else { b }
        })
        .collect()
}

/// `out[t, r]` as a plain f64 dot product, and the sum of the products' sizes (the bound of a
/// correct f32 sum's error, up to a factor).
fn reference(
    x: &[f32],
    n: usize,
    k: usize,
    row: impl Fn(usize) -> Vec<f32>,
    rows: usize,
) -> Vec<(f64, f64)> {
    let mut out = vec![(0.0, 0.0); n * rows];
    for r in 0..rows {
        let w = row(r);
        for t in 0..n {
            let xt = &x[t * k..(t + 1) * k];
            let dot = xt
                .iter()
                .zip(&w)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let size = xt
                .iter()
                .zip(&w)
                .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                .sum();
            out[t * rows + r] = (dot, size);
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[(f64, f64)], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, (w, size))) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 * size + 1e-30;
        assert!(
            (f64::from(*g) - w).abs() <= tol,
            "{what}: output {i} is {g}, want {w} (within {tol})"
        );
    }
}

/// Token counts that fill no tile, one, part of a second and many; row counts that leave a
/// block part full.
const TOKENS: [usize; 5] = [1, 7, LIN_TOKENS, LIN_TOKENS + 1, 65];
const ROWS: [usize; 4] = [1, 7, LIN_WARPS + 1, 17];

#[test]
fn the_half_linear_twin_computes_every_output_with_either_load_width() {
    // 8 and 264 features: whole 16-byte loads, 264 leaving lanes past the first stride; 36:
    // the one-weight path only.
    for k in [8, 36, 264] {
        for &n in &TOKENS {
            for &rows in &ROWS {
                let x = values(n * k, 1 + n as u64);
                let w: Vec<half::bf16> = values(rows * k, 7 + k as u64)
                    .into_iter()
                    .map(half::bf16::from_f32)
                    .collect();
                let want = reference(
                    &x,
                    n,
                    k,
                    |r| w[r * k..(r + 1) * k].iter().map(|v| v.to_f32()).collect(),
                    rows,
                );
                for vec in [false, true] {
                    if vec && k % 8 != 0 {
                        continue;
                    }
                    let got = linear_half(&x, |i| w[i].to_f32(), n, k, rows, vec);
                    assert_close(
                        &got,
                        &want,
                        &format!("n {n}, k {k}, rows {rows}, vec {vec}"),
                    );
                }
            }
        }
    }
}

#[test]
fn the_mxfp4_linear_twin_decodes_as_the_model_does() {
    // 1, 3 and 33 blocks a row: 33 gives lane 0 a second block.
    for k in [32, 96, 33 * 32] {
        for &n in &TOKENS {
            for &rows in &ROWS {
                let x = values(n * k, 3 + n as u64);
                let blocks = bytes(rows * k / 2, 11 + k as u64, false);
                let scales = bytes(rows * k / 32, 13 + rows as u64, true);
                let row = |r: usize| {
                    let mut w = vec![0f32; k];
                    mxfp4_row(&blocks, &scales, k, r, &mut w);
                    w
                };
                let want = reference(&x, n, k, row, rows);
                let got = linear_mxfp4(&x, &blocks, &scales, n, k, rows);
                assert_close(&got, &want, &format!("n {n}, k {k}, rows {rows}"));
            }
        }
    }
}

#[test]
fn the_moe_twins_give_each_pair_its_tokens_row_and_its_experts_rows() {
    let (experts, k) = (3usize, 96usize);
    for pairs in [1usize, 5, 65] {
        let tokens: Vec<u32> = (0..pairs as u32).map(|p| (p * 7) % 4).collect();
        let chosen: Vec<u32> = (0..pairs as u32)
            .map(|p| (p * 5 + 1) % experts as u32)
            .collect();
        let x = values(4 * k, 17);
        for &rows in &ROWS {
            // Each pair's reference: its token's row of x against its expert's rows.
            let pair_ref = |row: &dyn Fn(usize) -> Vec<f32>| -> Vec<(f64, f64)> {
                (0..pairs)
                    .flat_map(|p| {
                        let t = tokens[p] as usize;
                        let e = chosen[p] as usize;
                        reference(&x[t * k..(t + 1) * k], 1, k, |r| row(e * rows + r), rows)
                    })
                    .collect()
            };
            let w = values(experts * rows * k, 19);
            let want = pair_ref(&|r| w[r * k..(r + 1) * k].to_vec());
            let got = moe_dense(&x, &tokens, &chosen, |i| w[i], k, rows);
            assert_close(&got, &want, &format!("dense, {pairs} pairs, rows {rows}"));

            let blocks = bytes(experts * rows * k / 2, 23, false);
            let scales = bytes(experts * rows * k / 32, 29, true);
            let want = pair_ref(&|r| {
                let mut out = vec![0f32; k];
                mxfp4_row(&blocks, &scales, k, r, &mut out);
                out
            });
            let got = moe_mxfp4(&x, &tokens, &chosen, &blocks, &scales, k, rows);
            assert_close(&got, &want, &format!("mxfp4, {pairs} pairs, rows {rows}"));
        }
    }
}

#[test]
fn the_warp_sum_adds_every_lane_once() {
    let lanes: [f32; LANES] = std::array::from_fn(|l| (1u32 << (l % 20)) as f32);
    let want: f32 = lanes.iter().sum();
    assert_eq!(warp_sum(lanes), want);
    // An exact case where the butterfly's order shows: lane 0 pairs with 16, then 8, ...
    let mut one = [0f32; LANES];
    one[31] = 1.0;
    assert_eq!(warp_sum(one), 1.0);
}

#[test]
fn e8m0_scales_are_powers_of_two_and_zero_is_the_smallest() {
    assert_eq!(e8m0(127), 1.0);
    assert_eq!(e8m0(128), 2.0);
    assert_eq!(e8m0(1), 2f32.powi(-126));
    assert_eq!(e8m0(0), 2f32.powi(-127));
}
