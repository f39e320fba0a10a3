//! CPU twins of the linear and MoE kernels of `kernels/afd.cu` (`afd_linear_*`, `afd_moe_*`).
//! Each walks the data as its kernel does: a warp per output row over tiles of `LIN_TOKENS`
//! tokens (the last one part full), or per (token, expert) pair, the same lanes and strides,
//! the same grouping of products and the warp's butterfly sum. (The kernels group `LIN_WARPS`
//! rows into a block; no output depends on which block its warp is in, so the twins walk the
//! rows in order.) So the CPU tests of awkward
//! shapes (a row count or token count that leaves a block part full, features that are not a
//! whole number of lane strides) check the kernels' index arithmetic, not only the ops'
//! shapes; what differs on the GPU is the rounding of fused multiply-adds. Keep each twin in
//! step with its kernel.

use super::kernel_constants::LIN_TOKENS;

/// Threads of a warp.
const LANES: usize = 32;

/// One lane's running sums, one per token of the block.
type LaneAcc = [f32; LIN_TOKENS];

/// `warp_sum`: at offsets 16, 8, 4, 2, 1 every lane adds its partner's (`lane ^ offset`) value;
/// every lane ends with the same sum, lane 0's is returned.
fn warp_sum(mut lanes: [f32; LANES]) -> f32 {
    let mut offset = LANES / 2;
    while offset > 0 {
        let before = lanes;
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = before[l] + before[l ^ offset];
        }
        offset /= 2;
    }
    lanes[0]
}

/// Every (row, token tile) of a linear kernel's grid: `f(row, first token, tokens in the
/// tile)`, the last tile of `n % LIN_TOKENS` tokens where that is not 0.
fn linear_grid(n: usize, rows: usize, mut f: impl FnMut(usize, usize, usize)) {
    for t0 in (0..n).step_by(LIN_TOKENS) {
        for r in 0..rows {
            f(r, t0, LIN_TOKENS.min(n - t0));
        }
    }
}

/// The warp's sums of token `t` of its tile.
fn lane_sum(acc: &[LaneAcc; LANES], t: usize) -> f32 {
    warp_sum(std::array::from_fn(|l| acc[l][t]))
}

/// `linear_half` (`afd_linear_bf16`, `afd_linear_f16`): `out[t, r]` is the sum over the `k`
/// features `j` of `x[t, j] * w(r * k + j)`. With `vec` each lane takes 8 weights a step from
/// `lane * 8`, 256 apart, and adds the 8 products to a token's sum as one group; without, one
/// weight from `lane`, 32 apart.
pub(crate) fn linear_half(
    x: &[f32],
    w: impl Fn(usize) -> f32,
    n: usize,
    k: usize,
    rows: usize,
    vec: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; n * rows];
    linear_grid(n, rows, |r, t0, tc| {
        let mut acc = [[0f32; LIN_TOKENS]; LANES];
        let wr = r * k;
        for (lane, a) in acc.iter_mut().enumerate() {
            if vec {
                let mut kk = lane * 8;
                while kk < k {
                    let wv: [f32; 8] = std::array::from_fn(|i| w(wr + kk + i));
                    for (t, sum) in a.iter_mut().enumerate().take(tc) {
                        let xp = &x[(t0 + t) * k + kk..][..8];
                        let mut s = wv[0] * xp[0];
                        for (wi, xi) in wv.iter().zip(xp).skip(1) {
                            s += wi * xi;
                        }
                        *sum += s;
                    }
                    kk += LANES * 8;
                }
            } else {
                let mut kk = lane;
                while kk < k {
                    let wv = w(wr + kk);
                    for (t, sum) in a.iter_mut().enumerate().take(tc) {
                        *sum += wv * x[(t0 + t) * k + kk];
                    }
                    kk += LANES;
                }
            }
        }
        for t in 0..tc {
            out[(t0 + t) * rows + r] = lane_sum(&acc, t);
        }
    });
    out
}

/// `AFD_FP4`: the FP4 (E2M1) values by nibble.
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `e8m0`: 2^(s - 127), with 0 as 2^-127 (the f32 whose bits are `1 << 22`).
fn e8m0(s: u8) -> f32 {
    if s == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits(u32::from(s) << 23)
    }
}

/// `mxfp4_block`: block `g` of a row (16 bytes, byte j holding element 2j in its low nibble
/// and 2j + 1 in its high one) times its scale.
fn mxfp4_block(blocks: &[u8], scales: &[u8], g: usize) -> [f32; 32] {
    let s = e8m0(scales[g]);
    let raw = &blocks[g * 16..(g + 1) * 16];
    std::array::from_fn(|e| {
        let byte = raw[e / 2];
        let nibble = if e % 2 == 0 { byte & 0xf } else { byte >> 4 };
        FP4[usize::from(nibble)] * s
    })
}

/// `mxfp4_row_dot`: one MXFP4 row (`blocks`, `scales`) against `tc` rows of `x` (`x_stride`
/// apart) into each lane's sums: lane `l` takes blocks `l`, `l + 32`, ..., and adds a block's
/// 32 products to a token's sum as one group, built four at a time.
fn mxfp4_row_dot(
    x: &[f32],
    x_stride: usize,
    blocks: &[u8],
    scales: &[u8],
    k: usize,
    tc: usize,
    acc: &mut [LaneAcc; LANES],
) {
    for (lane, a) in acc.iter_mut().enumerate() {
        let mut g = lane;
        while g < k / 32 {
            let wv = mxfp4_block(blocks, scales, g);
            for (t, sum) in a.iter_mut().enumerate().take(tc) {
                let xp = &x[t * x_stride + g * 32..][..32];
                let mut s = 0f32;
                for i in 0..8 {
                    let q = 4 * i;
                    s += wv[q] * xp[q]
                        + wv[q + 1] * xp[q + 1]
                        + wv[q + 2] * xp[q + 2]
                        + wv[q + 3] * xp[q + 3];
                }
                *sum += s;
            }
            g += LANES;
        }
    }
}

/// `afd_linear_mxfp4`: `x [n, k]` against MXFP4 rows (`blocks [rows, k / 2]`, `scales [rows,
/// k / 32]`), `[n, rows]`.
pub(crate) fn linear_mxfp4(
    x: &[f32],
    blocks: &[u8],
    scales: &[u8],
    n: usize,
    k: usize,
    rows: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; n * rows];
    linear_grid(n, rows, |r, t0, tc| {
        let mut acc = [[0f32; LIN_TOKENS]; LANES];
        mxfp4_row_dot(
            &x[t0 * k..],
            k,
            &blocks[r * (k / 2)..],
            &scales[r * (k / 32)..],
            k,
            tc,
            &mut acc,
        );
        for t in 0..tc {
            out[(t0 + t) * rows + r] = lane_sum(&acc, t);
        }
    });
    out
}

/// Every (pair, output row) of an MoE kernel's grid, in the outputs' order.
fn pair_rows(pairs: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..pairs).flat_map(move |p| (0..rows).map(move |r| (p, r)))
}

/// `moe_dense` (`afd_moe_f32`, `_bf16`, `_f16`): pair `p`'s output row `r` is the dot of x's row
/// `tokens[p]` and row `experts[p] * rows + r` of the stacked weight (`w(flat index)`), each
/// lane taking columns `lane`, `lane + 32`, ... The caller checked every id.
pub(crate) fn moe_dense(
    x: &[f32],
    tokens: &[u32],
    experts: &[u32],
    w: impl Fn(usize) -> f32,
    k: usize,
    rows: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; tokens.len() * rows];
    for (o, (p, r)) in out.iter_mut().zip(pair_rows(tokens.len(), rows)) {
        let xr = tokens[p] as usize * k;
        let wr = (experts[p] as usize * rows + r) * k;
        let mut lanes = [0f32; LANES];
        for (lane, acc) in lanes.iter_mut().enumerate() {
            let mut kk = lane;
            while kk < k {
                *acc += w(wr + kk) * x[xr + kk];
                kk += LANES;
            }
        }
        *o = warp_sum(lanes);
    }
    out
}

/// `afd_moe_mxfp4`: [`moe_dense`] over stacked MXFP4 rows, one token a pair through the linear
/// kernel's row dot. The caller checked every id and that `k` is whole blocks.
pub(crate) fn moe_mxfp4(
    x: &[f32],
    tokens: &[u32],
    experts: &[u32],
    blocks: &[u8],
    scales: &[u8],
    k: usize,
    rows: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; tokens.len() * rows];
    for (o, (p, r)) in out.iter_mut().zip(pair_rows(tokens.len(), rows)) {
        let row = experts[p] as usize * rows + r;
        let mut acc = [[0f32; LIN_TOKENS]; LANES];
        mxfp4_row_dot(
            &x[tokens[p] as usize * k..],
            k,
            &blocks[row * (k / 2)..],
            &scales[row * (k / 32)..],
            k,
            1,
            &mut acc,
        );
        *o = lane_sum(&acc, 0);
    }
    out
}

#[cfg(test)]
mod tests;
