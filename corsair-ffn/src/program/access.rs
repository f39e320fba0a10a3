//! What each instruction reads and writes, at the program's largest shape.

use super::{Op, OutLayout, Program, RegionId, RowCount};

/// A byte range an instruction reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// The region.
    pub region: RegionId,
    /// First byte (relative to the region).
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// Write (else read).
    pub write: bool,
}

/// A reference an instruction makes to something the program does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingRef {
    /// A matrix id past the program's matrices.
    Matrix(u32),
    /// A tile id past its matrix's tiles.
    Tile {
        /// The matrix.
        matrix: u32,
        /// The tile.
        tile: u32,
    },
    /// A reduce whose `matmul` is not a matmul instruction.
    MatMul(u32),
}

impl std::fmt::Display for MissingRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MissingRef::Matrix(m) => write!(f, "matrix {m}, which does not exist"),
            MissingRef::Tile { matrix, tile } => {
                write!(f, "tile {tile} of matrix {matrix}, which does not exist")
            }
            MissingRef::MatMul(i) => write!(f, "instruction {i} as its matmul, which is not one"),
        }
    }
}

/// What one instruction touches: its byte ranges, and the references it makes that resolve to
/// nothing (whose bytes therefore cannot be known).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstructionAccesses {
    /// The reads and writes.
    pub accesses: Vec<Access>,
    /// The references to matrices, tiles or instructions that do not exist.
    pub missing: Vec<MissingRef>,
}

impl Program {
    /// Bytes of `count` rows routed to an expert or tokens, at the largest shape.
    fn max_rows(&self, _rows: RowCount) -> u64 {
        self.max_tokens as u64
    }

    /// The reads and writes of instruction `i`, at the largest shape, and the references it
    /// makes to matrices, tiles or instructions the program does not have (unknown region ids
    /// are accesses like any other: the sanitizer checks them against the regions).
    pub fn accesses(&self, i: usize) -> InstructionAccesses {
        let mut out = InstructionAccesses::default();
        self.walk_accesses(i, &mut out.accesses, &mut out.missing);
        out
    }

    fn walk_accesses(&self, i: usize, out: &mut Vec<Access>, missing: &mut Vec<MissingRef>) {
        let rd = |region, start, end| Access {
            region,
            start,
            end,
            write: false,
        };
        let wr = |region, start, end| Access {
            region,
            start,
            end,
            write: true,
        };
        let h = self.hidden as u64;
        let m = self.max_tokens as u64;
        let k = self.top_k as u64;
        let Some(op) = self.instructions.get(i) else {
            return;
        };
        let matrix = |id: u32| self.matrices.get(id as usize);
        match op {
            Op::Receive { x, slots } => {
                out.push(wr(*x, 0, m * h * 4));
                if let Some(s) = slots {
                    out.push(wr(*s, 0, m * k * 8));
                }
            }
            Op::Gather {
                slots,
                x,
                rows,
                map,
                ..
            } => {
                out.push(rd(*slots, 0, m * k * 8));
                out.push(rd(*x, 0, m * h * 4));
                out.push(wr(*rows, 0, m * h * 4));
                out.push(wr(*map, 0, m * 8));
            }
            Op::Stream {
                matrix: mi,
                tiles,
                staging,
                offsets,
            } => match matrix(*mi) {
                Some(mx) => {
                    for (t, off) in tiles.iter().zip(offsets) {
                        match mx.tiles.get(*t as usize) {
                            Some(tile) => {
                                let b = mx.tile_bytes(tile);
                                out.push(rd(tile.region, 0, b));
                                out.push(wr(*staging, *off, off + b));
                            }
                            None => missing.push(MissingRef::Tile {
                                matrix: *mi,
                                tile: *t,
                            }),
                        }
                    }
                }
                None => missing.push(MissingRef::Matrix(*mi)),
            },
            Op::MatMul {
                matrix: mi,
                rows,
                input,
                partials,
                tiles,
            } => match matrix(*mi) {
                Some(mx) => {
                    let r = self.max_rows(*rows);
                    out.push(rd(*input, 0, r * mx.cols as u64 * 4));
                    for run in tiles {
                        match mx.tiles.get(run.tile as usize) {
                            Some(tile) => {
                                let b = mx.tile_bytes(tile);
                                out.push(rd(
                                    run.weights,
                                    run.weights_offset,
                                    run.weights_offset + b,
                                ));
                                let p = m * tile.rows.len() as u64 * tile.segments.len() as u64 * 4;
                                out.push(wr(*partials, run.partial_offset, run.partial_offset + p));
                            }
                            None => missing.push(MissingRef::Tile {
                                matrix: *mi,
                                tile: run.tile,
                            }),
                        }
                    }
                }
                None => missing.push(MissingRef::Matrix(*mi)),
            },
            Op::Reduce {
                matmul,
                out: dst,
                layout,
            } => {
                let Some(Op::MatMul {
                    matrix: mi,
                    partials,
                    tiles,
                    ..
                }) = self.instructions.get(*matmul as usize)
                else {
                    missing.push(MissingRef::MatMul(*matmul));
                    return;
                };
                let Some(mx) = matrix(*mi) else {
                    missing.push(MissingRef::Matrix(*mi));
                    return;
                };
                let (mut lo, mut hi) = (usize::MAX, 0);
                for run in tiles {
                    if let Some(tile) = mx.tiles.get(run.tile as usize) {
                        let p = m * tile.rows.len() as u64 * tile.segments.len() as u64 * 4;
                        out.push(rd(*partials, run.partial_offset, run.partial_offset + p));
                        lo = lo.min(tile.rows.start);
                        hi = hi.max(tile.rows.end);
                    }
                }
                if let Some(b) = mx.bias {
                    out.push(rd(b, 0, mx.rows as u64 * 4));
                }
                if lo < hi {
                    match layout {
                        OutLayout::TokenMajor => out.push(wr(*dst, 0, m * mx.rows as u64 * 4)),
                        OutLayout::RowMajor => {
                            out.push(wr(*dst, lo as u64 * m * 4, hi as u64 * m * 4))
                        }
                    }
                }
            }
            Op::Activate {
                rows,
                gate_up,
                out: dst,
                width,
                ..
            } => {
                let r = self.max_rows(*rows);
                out.push(rd(*gate_up, 0, r * 2 * *width as u64 * 4));
                out.push(wr(*dst, 0, r * *width as u64 * 4));
            }
            Op::Scale { rows, values, map } => {
                let r = self.max_rows(*rows);
                out.push(rd(*map, 0, r * 8));
                out.push(rd(*values, 0, r * h * 4));
                out.push(wr(*values, 0, r * h * 4));
            }
            Op::SumSlots {
                slots,
                experts,
                out: dst,
            } => {
                out.push(rd(*slots, 0, m * k * 8));
                for (_, map, values) in experts {
                    out.push(rd(*map, 0, m * 8));
                    out.push(rd(*values, 0, m * h * 4));
                }
                out.push(wr(*dst, 0, m * h * 4));
            }
            Op::Fill { region } => {
                let bytes = self.regions.get(*region as usize).map_or(0, |r| r.bytes);
                out.push(wr(*region, 0, bytes));
            }
            Op::Send { src } => {
                let bytes = self.regions.get(*src as usize).map_or(0, |r| r.bytes);
                out.push(rd(*src, 0, bytes));
            }
            Op::Propose { logits, out: dst } => {
                let rows = self.lm_head.as_ref().map_or(0, |l| l.rows.len() as u64);
                out.push(rd(*logits, 0, rows * m * 4));
                let bytes = self.regions.get(*dst as usize).map_or(0, |r| r.bytes);
                out.push(wr(*dst, 0, bytes));
            }
        }
    }
}
