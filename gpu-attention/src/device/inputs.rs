//! What one micro-batch's layers need on the device, uploaded once per step: token ids, RoPE
//! tables, the slots its new keys and values go to, and the plan of its attention (which rows
//! take the paged kernel, which prompt chunks the matmul path over their gathered history).

use candle_core::{Device, Result, Tensor};
use model::forward::rope::RopeTables;
use step::KvCapacity;

use super::kv::slot;

/// Spans of at most this many new tokens (decode, short chunks) take the paged kernel; longer
/// prompt chunks the matmul path, whose set-up their matmuls pay for.
pub const PAGED_MAX_QUERIES: usize = 8;

/// One sequence's new tokens in a micro-batch.
#[derive(Debug, Clone, Copy)]
pub struct SpanInput<'a> {
    /// Its new tokens.
    pub tokens: &'a [u32],
    /// Tokens cached before them (the position of the first).
    pub past: usize,
    /// Its block table.
    pub table: &'a [u32],
}

/// The rows of a micro-batch that take the paged kernel.
#[derive(Debug, Clone)]
pub struct PagedRows {
    /// How many.
    pub count: usize,
    /// u32 `[count, 2]`: row of the sequence in `tables`, position.
    pub rows: Tensor,
    /// u32 `[sequences, max_blocks]`.
    pub tables: Tensor,
    /// u32 `[count]`: the micro-batch rows they are, when not all rows in order.
    pub select: Option<Tensor>,
}

/// A run of attention output rows, in micro-batch order.
#[derive(Debug, Clone)]
pub enum Piece {
    /// Rows `first..first + len` of the paged launch's output.
    Paged {
        /// First row in the paged output.
        first: usize,
        /// Rows.
        len: usize,
    },
    /// One long prompt chunk through the matmul path.
    Prefill {
        /// First row in the micro-batch.
        start: usize,
        /// Rows.
        len: usize,
        /// Tokens cached before it.
        past: usize,
        /// u32 `[past + len]`: the slots of its whole history.
        history: Tensor,
    },
}

/// One micro-batch's device inputs.
#[derive(Debug, Clone)]
pub struct MbInputs {
    /// Rows (tokens).
    pub rows: usize,
    /// u32 `[rows]` token ids.
    pub ids: Tensor,
    /// `[rows, head_dim / 2]`.
    pub cos: Tensor,
    /// `[rows, head_dim / 2]`.
    pub sin: Tensor,
    /// u32 `[rows, kv_heads * head_dim]`: every column of row `i` holds row `i`'s slot.
    pub store_index: Tensor,
    /// The paged launch, if any row takes it.
    pub paged: Option<PagedRows>,
    /// The attention output's pieces in row order.
    pub pieces: Vec<Piece>,
}

fn outside(p: usize, table: &[u32], capacity: KvCapacity) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "position {p} is outside its block table ({} blocks of {}, the cache has {})",
        table.len(),
        capacity.block_size,
        capacity.num_blocks
    ))
}

impl MbInputs {
    /// Uploads the inputs of `spans` (in row order) to `device`.
    pub fn new(
        spans: &[SpanInput<'_>],
        rope: &RopeTables,
        capacity: KvCapacity,
        kv_width: usize,
        device: &Device,
    ) -> Result<Self> {
        let rows: usize = spans.iter().map(|s| s.tokens.len()).sum();
        let half = rope.cos.len() / rows.max(1);
        let mut ids = Vec::with_capacity(rows);
        let mut slots = Vec::with_capacity(rows);
        let mut pieces = Vec::new();
        let (mut paged_rows, mut paged_select, mut paged_tables) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut max_blocks = 1;
        for s in spans {
            let start = ids.len();
            ids.extend_from_slice(s.tokens);
            let len = s.tokens.len();
            for p in s.past..s.past + len {
                slots
                    .push(slot(capacity, s.table, p).ok_or_else(|| outside(p, s.table, capacity))?);
            }
            if len <= PAGED_MAX_QUERIES {
                let table_row = paged_tables.len() as u32;
                let blocks = (s.past + len).div_ceil(capacity.block_size);
                max_blocks = max_blocks.max(blocks);
                // The kernel reads every block of the table without checking it: each must
                // exist, and be a block of the cache.
                let table = s
                    .table
                    .get(..blocks)
                    .ok_or_else(|| outside(s.past + len - 1, s.table, capacity))?;
                if let Some(&b) = table.iter().find(|&&b| b as usize >= capacity.num_blocks) {
                    return Err(candle_core::Error::Msg(format!(
                        "the block table names block {b}, past the cache's {} blocks",
                        capacity.num_blocks
                    )));
                }
                paged_tables.push(table);
                let first = paged_select.len();
                for (i, p) in (s.past..s.past + len).enumerate() {
                    paged_rows.extend([table_row, p as u32]);
                    paged_select.push((start + i) as u32);
                }
                match pieces.last_mut() {
                    Some(Piece::Paged { first: f, len: l }) if *f + *l == first => *l += len,
                    _ => pieces.push(Piece::Paged { first, len }),
                }
            } else {
                let history = (0..s.past + len)
                    .map(|p| {
                        slot(capacity, s.table, p).ok_or_else(|| outside(p, s.table, capacity))
                    })
                    .collect::<Result<Vec<u32>>>()?;
                pieces.push(Piece::Prefill {
                    start,
                    len,
                    past: s.past,
                    history: Tensor::from_vec(history, s.past + len, device)?,
                });
            }
        }
        let paged = if paged_select.is_empty() {
            None
        } else {
            let count = paged_select.len();
            let in_order = count == rows;
            let mut tables = Vec::with_capacity(paged_tables.len() * max_blocks);
            for t in &paged_tables {
                tables.extend_from_slice(t);
                // Padding past a table's end is never read; block 0 always exists.
                tables.extend(std::iter::repeat_n(0, max_blocks - t.len()));
            }
            Some(PagedRows {
                count,
                rows: Tensor::from_vec(paged_rows, (count, 2), device)?,
                tables: Tensor::from_vec(tables, (paged_tables.len(), max_blocks), device)?,
                select: if in_order {
                    None
                } else {
                    Some(Tensor::from_vec(paged_select, count, device)?)
                },
            })
        };
        let store_index = Tensor::from_vec(slots, (rows, 1), device)?
            .broadcast_as((rows, kv_width))?
            .contiguous()?;
        Ok(MbInputs {
            rows,
            ids: Tensor::from_vec(ids, rows, device)?,
            cos: Tensor::from_slice(&rope.cos, (rows, half), device)?,
            sin: Tensor::from_slice(&rope.sin, (rows, half), device)?,
            store_index,
            paged,
            pieces,
        })
    }
}
