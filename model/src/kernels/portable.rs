//! The portable matrix kernel: the same terms in the same order as the AVX-512 and AVX2 paths,
//! one lane at a time.

use super::{BLOCK, BlockRows, LANES, Reduction, Sink, SumOrder, fold_lanes};

/// See [`super::block_sums`] (sizes already checked).
pub(super) fn block_sums<O: SumOrder, const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[f32]; T],
    reduction: &Reduction,
    mut emit: impl Sink<R, T>,
) {
    let lanes = O::lanes(w.format);
    let blocks = &reduction.blocks;
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        let last = segment.end;
        let mut out = [[0f32; T]; R];
        for (r, out) in out.iter_mut().enumerate() {
            let mut acc = [[0f32; LANES]; T];
            for b in segment.clone() {
                let (wa, wb) = w.block(r, b, lanes);
                for (acc, x) in acc.iter_mut().zip(x) {
                    let xb = &x[b * BLOCK..(b + 1) * BLOCK];
                    for l in 0..LANES {
                        acc[l] = O::add_term(acc[l], wa[l], xb[l]);
                    }
                    for l in 0..LANES {
                        acc[l] = O::add_term(acc[l], wb[l], xb[LANES + l]);
                    }
                }
            }
            if reduction.half && last == blocks.end {
                let b = blocks.end;
                let wa = w.half_block(r, b);
                for (acc, x) in acc.iter_mut().zip(x) {
                    for l in 0..LANES {
                        acc[l] = O::add_term(acc[l], wa[l], x[b * BLOCK + l]);
                    }
                }
            }
            for (o, acc) in out.iter_mut().zip(acc) {
                *o = fold_lanes(acc);
            }
        }
        emit.segment(s, &out);
    }
}
