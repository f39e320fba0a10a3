//! Binding weights to a compiled program: where each matrix row comes from in the checkpoint
//! ([`MatrixSource`]), and the card's memories with every tile and bias written at its
//! address in the program's storage format ([`BoundMemory`]).

use std::collections::BTreeSet;

use model::weights::{FfnWeights, GatedMlp};
use model::{ModelWeights, WeightMatrix};
use rayon::prelude::*;

use crate::assignment::{LayerShare, Span};
use crate::error::{Error, Result};
use crate::executor::kernel::pack_rows;
use crate::format::{TileFormat, encode_row};
use crate::program::{Matrix, MatrixRole, MemoryKind, Program};

/// Where a card's weights come from: a loaded checkpoint, or weights made in memory.
pub trait WeightSource {
    /// Expert `expert` of layer `layer`, if loaded.
    fn expert(&self, layer: usize, expert: usize) -> Option<&GatedMlp>;
    /// The dense FFN of layer `layer`, if it is dense.
    fn dense(&self, layer: usize) -> Option<&GatedMlp>;
    /// The LM head `[vocab, hidden]`.
    fn lm_head(&self) -> Option<&WeightMatrix>;
}

impl WeightSource for ModelWeights {
    fn expert(&self, layer: usize, expert: usize) -> Option<&GatedMlp> {
        match &self.layers.get(layer)?.ffn {
            FfnWeights::Moe(m) => m.experts.get(expert)?.as_ref(),
            FfnWeights::Dense(_) => None,
        }
    }

    fn dense(&self, layer: usize) -> Option<&GatedMlp> {
        match &self.layers.get(layer)?.ffn {
            FfnWeights::Dense(m) => Some(m),
            FfnWeights::Moe(_) => None,
        }
    }

    fn lm_head(&self) -> Option<&WeightMatrix> {
        Some(&self.lm_head)
    }
}

/// The checkpoint rows behind one card matrix: row `r` of the card matrix is row
/// `first + (r - offset)` of the part holding it, restricted to columns `cols`.
pub struct MatrixSource<'a> {
    parts: Vec<(&'a WeightMatrix, usize, usize)>,
    /// Columns of the source rows that make the card's row.
    pub cols: Span,
    /// The bias (card rows), if any.
    pub bias: Option<Vec<f32>>,
}

impl<'a> MatrixSource<'a> {
    /// The source matrix and row of card row `r`.
    pub fn row(&self, mut r: usize) -> (&'a WeightMatrix, usize) {
        for &(m, first, count) in &self.parts {
            if r < count {
                return (m, first + r);
            }
            r -= count;
        }
        // Callers iterate over the matrix's own rows, which the parts cover (checked at build).
        let (m, first, count) = self.parts[self.parts.len() - 1];
        (m, first + count - 1)
    }

    /// Drops the source rows' checkpoint pages from this process's page tables (see
    /// [`WeightMatrix::release_rows`]), once they are written to the card.
    pub fn release_pages(&self) {
        for &(m, first, count) in &self.parts {
            m.release_rows(first, count);
        }
    }

    /// Finds the rows of `matrix` of `program` in `source`, checking shapes and formats.
    pub fn find(program: &Program, matrix: &Matrix, source: &'a dyn WeightSource) -> Result<Self> {
        let missing = |what: String| {
            Error::Weights(format!(
                "the program needs {what} ({}) but the weights do not include it; load the checkpoint \
                 with this card's expert filter (CardAssignment::expert_filter)",
                matrix.name
            ))
        };
        let layer_mlp = |layer: u32, expert: Option<u32>| -> Result<&'a GatedMlp> {
            match expert {
                Some(e) => source
                    .expert(layer as usize, e as usize)
                    .ok_or_else(|| missing(format!("expert {e} of layer {layer}"))),
                None => source
                    .dense(layer as usize)
                    .ok_or_else(|| missing(format!("the dense FFN of layer {layer}"))),
            }
        };
        let columns = |layer: u32, expert: Option<u32>, full: usize| match (
            expert,
            program.assignment.layers.get(layer as usize),
        ) {
            (None, Some(LayerShare::Dense { columns })) => *columns,
            _ => Span::new(0, full),
        };
        let concat = |a: &Option<Vec<f32>>, b: &Option<Vec<f32>>, span: Span| match (a, b) {
            (Some(a), Some(b)) => {
                Some([&a[span.start..span.end], &b[span.start..span.end]].concat())
            }
            _ => None,
        };
        let src = match matrix.role {
            MatrixRole::GateUp { layer, expert } => {
                let mlp = layer_mlp(layer, expert)?;
                let c = columns(layer, expert, mlp.gate.weight.rows());
                MatrixSource {
                    parts: vec![
                        (&mlp.gate.weight, c.start, c.len()),
                        (&mlp.up.weight, c.start, c.len()),
                    ],
                    cols: Span::new(0, mlp.gate.weight.cols()),
                    bias: concat(&mlp.gate.bias, &mlp.up.bias, c),
                }
            }
            MatrixRole::Down { layer, expert } => {
                let mlp = layer_mlp(layer, expert)?;
                let c = columns(layer, expert, mlp.down.weight.cols());
                let bias = if c.start == 0 {
                    mlp.down.bias.clone()
                } else {
                    None
                };
                MatrixSource {
                    parts: vec![(&mlp.down.weight, 0, mlp.down.weight.rows())],
                    cols: c,
                    bias,
                }
            }
            MatrixRole::LmHead => {
                let lm = source
                    .lm_head()
                    .ok_or_else(|| missing("the LM head".into()))?;
                let rows = program.lm_head.as_ref().map_or(Span::new(0, 0), |l| l.rows);
                MatrixSource {
                    parts: vec![(lm, rows.start, rows.len())],
                    cols: Span::new(0, lm.cols()),
                    bias: None,
                }
            }
        };
        let rows: usize = src.parts.iter().map(|p| p.2).sum();
        let fits = src
            .parts
            .iter()
            .all(|&(m, first, count)| first + count <= m.rows() && src.cols.end <= m.cols());
        if rows != matrix.rows || src.cols.len() != matrix.cols || !fits {
            return Err(Error::Weights(format!(
                "{} is compiled as [{}, {}] but the weights give [{rows}, {}]; recompile for this checkpoint",
                matrix.name,
                matrix.rows,
                matrix.cols,
                src.cols.len()
            )));
        }
        if let Some(&(m, _, _)) = src.parts.first() {
            let stored = TileFormat::from_stored(m.format());
            if stored != matrix.source_format {
                return Err(Error::Weights(format!(
                    "{} was compiled for a checkpoint storing {} but this one stores {stored}; recompile from its config.json",
                    matrix.name, matrix.source_format
                )));
            }
        }
        if src.bias.is_some() != matrix.bias.is_some() {
            return Err(Error::Weights(format!(
                "{}: the weights {} a bias but the program {}; recompile for this checkpoint",
                matrix.name,
                if src.bias.is_some() { "have" } else { "lack" },
                if matrix.bias.is_some() {
                    "expects one"
                } else {
                    "has none"
                }
            )));
        }
        Ok(src)
    }
}

/// A zeroed, 64-byte aligned byte buffer (pages are only touched where written).
#[derive(Debug, Clone, Default)]
pub struct AlignedBytes {
    words: Vec<[u64; 8]>,
    len: usize,
}

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let words = vec![[0u64; 8]; len.div_ceil(64)];
        huge_pages(&words);
        AlignedBytes { words, len }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..len]
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Asks the kernel to back `words` with transparent huge pages where it allows them only on
/// request (`madvise` mode): the kernels stream weights sequentially, and with 4 KB pages
/// every 4 KB of weights costs a TLB miss, which the hardware prefetcher will not cross.
/// Only whole 2 MB pages inside the buffer are asked for, before they are first written.
fn huge_pages(words: &[[u64; 8]]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = words.as_ptr() as usize;
        let end = start + std::mem::size_of_val(words);
        let (first, last) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if last > first {
            // SAFETY: the range lies inside `words`' allocation; MADV_HUGEPAGE only changes
            // how the kernel backs the pages, never their contents. A refusal costs nothing.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = words;
}

/// The card's memories holding every resident region (tiles, biases).
///
/// The host keeps them compact and in program order (matrix by matrix, tile by tile) rather
/// than at their card addresses: the card's placement is proven by the sanitizer and modeled
/// by the performance model; on the CPU, threads taking consecutive tiles of a matmul then read
/// consecutive memory.
#[derive(Debug, Clone, Default)]
pub struct BoundMemory {
    /// Resident SRAM regions.
    pub sram: AlignedBytes,
    /// Resident LPDDR regions.
    pub lpddr: AlignedBytes,
    /// Host offset of each resident region (by region id; `u64::MAX` for others).
    offsets: Vec<u64>,
}

impl BoundMemory {
    /// The bytes of resident region `id`.
    pub fn region(&self, program: &Program, id: u32) -> Option<&[u8]> {
        let r = program.regions.get(id as usize)?;
        let at = *self.offsets.get(id as usize)?;
        if at == u64::MAX {
            return None;
        }
        let image = match r.memory {
            MemoryKind::Sram => self.sram.as_bytes(),
            MemoryKind::Lpddr => self.lpddr.as_bytes(),
        };
        image.get(at as usize..(at + r.bytes) as usize)
    }
}

/// Card bytes [`bind`] writes between releases of the checkpoint pages it read them from.
const BIND_BATCH_BYTES: usize = 64 << 20;

/// Writes every matrix of `program` from `source` into the card's memories.
pub fn bind(program: &Program, source: &dyn WeightSource) -> Result<BoundMemory> {
    // Host layout: program order, 64-byte aligned.
    let mut offsets = vec![u64::MAX; program.regions.len()];
    let (mut sram_len, mut lpddr_len) = (0u64, 0u64);
    for m in &program.matrices {
        for id in m.tiles.iter().map(|t| t.region).chain(m.bias) {
            let r = program.region(id);
            let len = match r.memory {
                MemoryKind::Sram => &mut sram_len,
                MemoryKind::Lpddr => &mut lpddr_len,
            };
            offsets[id as usize] = *len;
            *len += r.bytes.next_multiple_of(64);
        }
    }
    let mut memory = BoundMemory {
        sram: AlignedBytes::zeroed(sram_len as usize),
        lpddr: AlignedBytes::zeroed(lpddr_len as usize),
        offsets,
    };
    let sources: Vec<MatrixSource<'_>> = program
        .matrices
        .iter()
        .map(|m| MatrixSource::find(program, m, source))
        .collect::<Result<_>>()?;
    // One job per resident region: (memory, host offset, bytes, matrix, tile or bias).
    let mut jobs: Vec<(MemoryKind, u64, u64, usize, Option<usize>)> = Vec::new();
    for (mi, m) in program.matrices.iter().enumerate() {
        for (ti, t) in m.tiles.iter().enumerate() {
            let r = program.region(t.region);
            jobs.push((
                r.memory,
                memory.offsets[t.region as usize],
                r.bytes,
                mi,
                Some(ti),
            ));
        }
        if let Some(b) = m.bias {
            let r = program.region(b);
            jobs.push((r.memory, memory.offsets[b as usize], r.bytes, mi, None));
        }
    }
    for mem in [MemoryKind::Sram, MemoryKind::Lpddr] {
        let mut mine: Vec<_> = jobs.iter().filter(|j| j.0 == mem).copied().collect();
        mine.sort_by_key(|j| j.1);
        let image = match mem {
            MemoryKind::Sram => memory.sram.as_bytes_mut(),
            MemoryKind::Lpddr => memory.lpddr.as_bytes_mut(),
        };
        let mut chunks: Vec<(&mut [u8], usize, Option<usize>)> = Vec::with_capacity(mine.len());
        let mut rest = image;
        let mut at = 0u64;
        for &(_, addr, bytes, mi, tile) in &mine {
            if addr < at {
                return Err(Error::Weights(format!(
                    "a matrix lists region at host offset {addr:#x} twice; the program is malformed"
                )));
            }
            let (_, tail) = rest.split_at_mut((addr - at) as usize);
            let (chunk, tail) = tail.split_at_mut(bytes as usize);
            chunks.push((chunk, mi, tile));
            rest = tail;
            at = addr + bytes;
        }
        // Written in batches of whole matrices, each released from the page tables once
        // written: the checkpoint's pages behind a shard are then resident a batch at a time
        // rather than all together until the load ends (1.4 GB per card of GPT-OSS-20B, on top
        // of every copy made so far).
        let mut pending = chunks.into_iter().peekable();
        while pending.peek().is_some() {
            let mut batch = Vec::new();
            let mut bytes = 0usize;
            while let Some(c) = pending.next_if(|c| {
                bytes < BIND_BATCH_BYTES || batch.last().is_some_and(|l: &(_, usize, _)| l.1 == c.1)
            }) {
                bytes += c.0.len();
                batch.push(c);
            }
            let written: BTreeSet<usize> = batch.iter().map(|c| c.1).collect();
            batch.into_par_iter().for_each(|(chunk, mi, tile)| {
                let m = &program.matrices[mi];
                let src = &sources[mi];
                match tile {
                    Some(ti) => write_tile(m, ti, src, chunk),
                    None => {
                        if let Some(b) = &src.bias {
                            for (dst, v) in chunk.chunks_exact_mut(4).zip(b) {
                                dst.copy_from_slice(&v.to_le_bytes());
                            }
                        }
                    }
                }
            });
            for mi in written {
                sources[mi].release_pages();
            }
        }
    }
    Ok(memory)
}

/// Encodes tile `ti` of `m` into `out` in the kernel's tile storage layout.
fn write_tile(m: &Matrix, ti: usize, src: &MatrixSource<'_>, out: &mut [u8]) {
    let t = &m.tiles[ti];
    let cols = m.columns(t.segments);
    pack_rows(
        m.format,
        t.rows.len(),
        cols.len(),
        |i, data, scales| {
            let (w, row) = src.row(t.rows.start + i);
            encode_row(
                w, row, src.cols, m.format, cols.start, cols.end, data, scales,
            );
        },
        out,
    );
}
