//! The card's memories on the host: every resident tile and bias written at its host place
//! ([`BoundMemory`], [`bind`]) in the program's storage format.

use rayon::prelude::*;

use super::{MatrixSource, WeightSource};
use crate::error::{Error, Result};
use crate::executor::kernel::pack_tile;
use crate::format::encode_row;
use crate::program::{Matrix, MemoryKind, Program};

/// A zeroed, 64-byte aligned byte buffer (pages are only touched where written).
///
/// The words are allocated zeroed (so untouched pages stay unmapped) with one line to spare,
/// and the bytes start at the first 64-byte boundary: the allocator aligns them to 8 bytes
/// only, and a large allocation starts 16 bytes into its pages, so every other 32-byte block
/// of the cards' tiles straddled two cache lines.
#[derive(Debug, Default)]
pub struct AlignedBytes {
    words: Vec<[u64; 8]>,
    len: usize,
}

/// A copy has its own allocation, whose first boundary may lie elsewhere in its words: the
/// bytes are copied, not the words.
impl Clone for AlignedBytes {
    fn clone(&self) -> Self {
        let mut copy = AlignedBytes::zeroed(self.len);
        copy.as_bytes_mut().copy_from_slice(self.as_bytes());
        copy
    }
}

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let words = vec![[0u64; 8]; len.div_ceil(64) + 1];
        huge_pages(&words);
        AlignedBytes { words, len }
    }

    /// Where the bytes start in the words (none for an empty buffer, whose words may not
    /// even be allocated).
    fn start(bytes: &[u8]) -> usize {
        if bytes.is_empty() {
            0
        } else {
            bytes.as_ptr().align_offset(64)
        }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        let at = Self::start(bytes);
        &bytes[at..at + self.len]
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words);
        let at = Self::start(bytes);
        &mut bytes[at..at + len]
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
/// consecutive memory. A tile's scales (MX formats) are kept apart from its data, after every
/// tile's data, so that the tiles of a matrix, and the matrices one after another, are one
/// unbroken stream: with the scales between them, the hardware prefetcher lost the stream at
/// every tile (GPT-OSS-20B's MXFP4 expert is 270 tiles;
/// `docs/bench/notes/2026-12-03-weights-as-one-stream.md`).
#[derive(Debug, Clone, Default)]
pub struct BoundMemory {
    /// Resident SRAM regions.
    pub sram: AlignedBytes,
    /// Resident LPDDR regions.
    pub lpddr: AlignedBytes,
    /// Where each resident region lies in its memory's image (by region id; `None` for
    /// regions that are not resident).
    places: Vec<Option<HostPlace>>,
}

/// Where one resident region lies on the host: its bytes (a tile's data) and, for a tile
/// with scales, its scales elsewhere in the same image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HostPlace {
    at: u64,
    len: u64,
    scales_at: u64,
    scales_len: u64,
}

impl BoundMemory {
    fn image(&self, program: &Program, id: u32) -> Option<(&[u8], HostPlace)> {
        let r = program.regions.get(id as usize)?;
        let place = (*self.places.get(id as usize)?)?;
        let image = match r.memory {
            MemoryKind::Sram => self.sram.as_bytes(),
            MemoryKind::Lpddr => self.lpddr.as_bytes(),
        };
        Some((image, place))
    }

    /// The bytes of resident region `id` when they are stored whole: a bias, or a tile
    /// without scales. `None` for a tile with scales (see [`BoundMemory::tile`]).
    pub fn region(&self, program: &Program, id: u32) -> Option<&[u8]> {
        let (image, p) = self.image(program, id)?;
        if p.scales_len > 0 {
            return None;
        }
        image.get(p.at as usize..(p.at + p.len) as usize)
    }

    /// A resident tile's data and scales (empty for formats without scales).
    pub fn tile(&self, program: &Program, id: u32) -> Option<(&[u8], &[u8])> {
        let (image, p) = self.image(program, id)?;
        Some((
            image.get(p.at as usize..(p.at + p.len) as usize)?,
            image.get(p.scales_at as usize..(p.scales_at + p.scales_len) as usize)?,
        ))
    }
}

/// Card bytes [`bind`] writes between releases of the checkpoint pages it read them from.
const BIND_BATCH_BYTES: usize = 64 << 20;

/// What one piece of a memory image holds.
#[derive(Debug, Clone, Copy)]
enum Piece {
    Data(usize),
    Scales(usize),
    Bias,
}

/// A piece of a memory image: where it lies, and whose it is.
#[derive(Debug, Clone, Copy)]
struct HostPiece {
    memory: MemoryKind,
    at: u64,
    bytes: u64,
    matrix: usize,
    piece: Piece,
}

/// A piece of a memory image, once cut out.
type Chunk<'a> = Option<&'a mut [u8]>;

/// The image pieces of one matrix: each tile's data and scales, and the bias.
struct MatrixChunks<'a> {
    tiles: Vec<(Chunk<'a>, Chunk<'a>)>,
    bias: Chunk<'a>,
}

/// One write of a bind batch.
enum Write<'a> {
    Tile {
        matrix: usize,
        tile: usize,
        data: &'a mut [u8],
        scales: &'a mut [u8],
    },
    Bias {
        matrix: usize,
        bytes: &'a mut [u8],
    },
}

/// Writes every matrix of `program` from `source` into the card's memories.
pub fn bind(program: &Program, source: &dyn WeightSource) -> Result<BoundMemory> {
    // Host layout (see [`BoundMemory`]): in each memory, every tile's data in program order,
    // then every tile's scales and every bias in program order, each 64-byte aligned.
    let mut places: Vec<Option<HostPlace>> = vec![None; program.regions.len()];
    let (mut sram_len, mut lpddr_len) = (0u64, 0u64);
    let mut pieces: Vec<HostPiece> = Vec::new();
    for scales_pass in [false, true] {
        for (mi, m) in program.matrices.iter().enumerate() {
            let tiles = m.tiles.iter().enumerate().map(|(ti, t)| {
                let scales =
                    (t.rows.len() * m.format.scale_bytes(m.columns(t.segments).len())) as u64;
                (t.region, Some((ti, scales)))
            });
            for (id, tile) in tiles.chain(m.bias.map(|b| (b, None))) {
                let r = program.region(id);
                let len = match r.memory {
                    MemoryKind::Sram => &mut sram_len,
                    MemoryKind::Lpddr => &mut lpddr_len,
                };
                let slot = &mut places[id as usize];
                if !scales_pass {
                    if slot.is_some() {
                        return Err(Error::Weights(format!(
                            "{}: region {} is listed twice; the program is malformed",
                            m.name, r.name
                        )));
                    }
                    *slot = Some(HostPlace {
                        at: 0,
                        len: r.bytes,
                        scales_at: 0,
                        scales_len: 0,
                    });
                }
                let Some(place) = slot.as_mut() else {
                    return Err(Error::Weights(format!(
                        "{}: region {} has no host place",
                        m.name, r.name
                    )));
                };
                let (bytes, piece) = match (tile, scales_pass) {
                    (Some((ti, scales)), false) => {
                        if scales > r.bytes {
                            return Err(Error::Weights(format!(
                                "{}: tile {ti} has {} bytes, fewer than its {scales} bytes of scales; the program is malformed",
                                m.name, r.bytes
                            )));
                        }
                        place.len = r.bytes - scales;
                        place.at = *len;
                        (place.len, Piece::Data(ti))
                    }
                    (Some((ti, scales)), true) => {
                        place.scales_len = scales;
                        place.scales_at = *len;
                        (scales, Piece::Scales(ti))
                    }
                    (None, false) => continue,
                    (None, true) => {
                        place.at = *len;
                        (r.bytes, Piece::Bias)
                    }
                };
                pieces.push(HostPiece {
                    memory: r.memory,
                    at: *len,
                    bytes,
                    matrix: mi,
                    piece,
                });
                *len += bytes.next_multiple_of(64);
            }
        }
    }
    let mut memory = BoundMemory {
        sram: AlignedBytes::zeroed(sram_len as usize),
        lpddr: AlignedBytes::zeroed(lpddr_len as usize),
        places,
    };
    let sources: Vec<MatrixSource<'_>> = program
        .matrices
        .iter()
        .map(|m| MatrixSource::find(program, m, source))
        .collect::<Result<_>>()?;
    // The images cut into their pieces, gathered by matrix.
    let mut matrices: Vec<MatrixChunks<'_>> = program
        .matrices
        .iter()
        .map(|m| MatrixChunks {
            tiles: m.tiles.iter().map(|_| (None, None)).collect(),
            bias: None,
        })
        .collect();
    let images = [
        (MemoryKind::Sram, memory.sram.as_bytes_mut()),
        (MemoryKind::Lpddr, memory.lpddr.as_bytes_mut()),
    ];
    for (mem, image) in images {
        let mut rest = image;
        let mut at = 0u64;
        for &HostPiece {
            at: addr,
            bytes,
            matrix: mi,
            piece,
            ..
        } in pieces.iter().filter(|p| p.memory == mem)
        {
            // Pieces were placed in ascending order, each after the last.
            if addr < at {
                return Err(Error::Weights(format!(
                    "host piece at {addr:#x} overlaps the one before it"
                )));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((addr - at) as usize);
            let (chunk, tail) = tail.split_at_mut(bytes as usize);
            rest = tail;
            at = addr + bytes;
            let chunks = &mut matrices[mi];
            match piece {
                Piece::Data(ti) => chunks.tiles[ti].0 = Some(chunk),
                Piece::Scales(ti) => chunks.tiles[ti].1 = Some(chunk),
                Piece::Bias => chunks.bias = Some(chunk),
            }
        }
    }
    // Written in batches of whole matrices, each released from the page tables once
    // written: the checkpoint's pages behind a shard are then resident a batch at a time
    // rather than all together until the load ends (1.4 GB per card of GPT-OSS-20B, on top
    // of every copy made so far).
    let mut pending = matrices.into_iter().enumerate().peekable();
    while pending.peek().is_some() {
        let mut batch: Vec<Write<'_>> = Vec::new();
        let mut written = Vec::new();
        let mut bytes = 0usize;
        while let Some((mi, chunks)) = pending.next_if(|_| bytes < BIND_BATCH_BYTES) {
            written.push(mi);
            for (ti, pieces) in chunks.tiles.into_iter().enumerate() {
                let (Some(data), Some(scales)) = pieces else {
                    return Err(Error::Weights(format!(
                        "{}: tile {ti} has no host place; the program is malformed",
                        program.matrices[mi].name
                    )));
                };
                bytes += data.len() + scales.len();
                batch.push(Write::Tile {
                    matrix: mi,
                    tile: ti,
                    data,
                    scales,
                });
            }
            if let Some(bytes) = chunks.bias {
                batch.push(Write::Bias { matrix: mi, bytes });
            }
        }
        batch.into_par_iter().for_each(|write| match write {
            Write::Tile {
                matrix,
                tile,
                data,
                scales,
            } => write_tile(
                &program.matrices[matrix],
                tile,
                &sources[matrix],
                data,
                scales,
            ),
            Write::Bias { matrix, bytes } => {
                if let Some(b) = &sources[matrix].bias {
                    for (dst, v) in bytes.chunks_exact_mut(4).zip(b) {
                        dst.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        });
        for mi in written {
            sources[mi].release_pages();
        }
    }
    Ok(memory)
}

/// Encodes tile `ti` of `m` into `data` and `scales` in the kernel's tile storage layout.
fn write_tile(m: &Matrix, ti: usize, src: &MatrixSource<'_>, data: &mut [u8], scales: &mut [u8]) {
    let t = &m.tiles[ti];
    let cols = m.columns(t.segments);
    pack_tile(
        m.format,
        t.rows.len(),
        cols.len(),
        |i, data, scales| {
            let (w, row) = src.row(t.rows.start + i);
            encode_row(
                w, row, src.cols, m.format, cols.start, cols.end, data, scales,
            );
        },
        data,
        scales,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::{PlacementOptions, plan_placement};
    use crate::compiler::{CompileOptions, StoredFormats, TilingOptions, compile};
    use crate::format::TileFormat;
    use crate::profile::HardwareProfile;
    use crate::synthetic::{SyntheticWeights, gpt_oss_config};
    use model::weights::WeightFormat;

    /// MXFP4 experts in 7-row tiles (data not in whole 64-byte lines, a shorter last band),
    /// bf16 LM head.
    fn bound() -> (Program, SyntheticWeights, BoundMemory) {
        let cfg = gpt_oss_config(2, 4, 2, 64 * 5 + 32, 96, 40);
        let weights = SyntheticWeights::random(&cfg, WeightFormat::Mxfp4, 3, &|_, _| true);
        let stored = StoredFormats {
            experts: TileFormat::Mxfp4,
            ..StoredFormats::uniform(TileFormat::Bf16)
        };
        let plan = plan_placement(
            &cfg,
            &PlacementOptions {
                cards: 1,
                replicas: vec![],
            },
        )
        .unwrap();
        let options = CompileOptions {
            max_tokens: 4,
            tiling: TilingOptions {
                rows_per_tile: Some(7),
                segments_per_tile: None,
            },
            ..CompileOptions::default()
        };
        let program = compile(
            &cfg,
            &stored,
            &plan[0],
            &options,
            &HardwareProfile::default(),
        )
        .unwrap()
        .program;
        let memory = bind(&program, &weights).unwrap();
        (program, weights, memory)
    }

    #[test]
    fn tile_data_is_one_stream_with_the_scales_after_it() {
        let (program, _, memory) = bound();
        let mut last_data_end = [0usize; 2];
        let mut first_scales = [usize::MAX; 2];
        let mut scaled_tiles = 0;
        for m in &program.matrices {
            let mut previous_end: Option<usize> = None;
            for t in &m.tiles {
                let (data, scales) = memory.tile(&program, t.region).unwrap();
                let kind = program.region(t.region).memory as usize;
                let (start, end) = (data.as_ptr() as usize, data.as_ptr() as usize + data.len());
                // Each tile starts a cache line; the next one follows at the next boundary.
                assert_eq!(start % 64, 0, "{}: a tile off its cache line", m.name);
                if let Some(p) = previous_end {
                    assert_eq!(start, p.next_multiple_of(64), "{}: tiles apart", m.name);
                }
                previous_end = Some(end);
                last_data_end[kind] = last_data_end[kind].max(end);
                if m.format.has_scales() {
                    scaled_tiles += 1;
                    assert_eq!(
                        scales.len(),
                        t.rows.len() * m.format.scale_bytes(m.columns(t.segments).len())
                    );
                    first_scales[kind] = first_scales[kind].min(scales.as_ptr() as usize);
                    // A tile stored apart is not handed out as one region.
                    assert!(memory.region(&program, t.region).is_none());
                } else {
                    assert!(scales.is_empty());
                    assert_eq!(memory.region(&program, t.region), Some(data));
                }
            }
            if let Some(b) = m.bias {
                assert!(memory.region(&program, b).is_some());
            }
        }
        assert!(scaled_tiles > 4, "the test needs MXFP4 tiles");
        for kind in 0..2 {
            assert!(first_scales[kind] == usize::MAX || first_scales[kind] >= last_data_end[kind]);
        }
    }

    #[test]
    fn aligned_bytes_start_on_a_cache_line() {
        assert!(AlignedBytes::default().as_bytes().is_empty());
        assert!(AlignedBytes::zeroed(0).clone().as_bytes().is_empty());
        for len in [1, 64, 1000, 300 << 10, 5 << 20] {
            let mut b = AlignedBytes::zeroed(len);
            assert_eq!(b.as_bytes().len(), len);
            assert_eq!(b.as_bytes().as_ptr() as usize % 64, 0, "{len} bytes");
            b.as_bytes_mut()[len - 1] = 7;
            let c = b.clone();
            assert_eq!(
                c.as_bytes().as_ptr() as usize % 64,
                0,
                "a clone of {len} bytes"
            );
            assert_eq!(c.as_bytes()[len - 1], 7);
            assert!(c.as_bytes()[..len - 1].iter().all(|&x| x == 0));
        }
    }

    /// What `bind` stored, unpacked row by row (`unpack_row`, the packing's inverse), is each
    /// source row's own encoding: the right rows of the right matrix, in the right columns,
    /// each row pair's nibbles apart again. (That `unpack_row` inverts the packing is checked
    /// in the kernel's tests; that the executor computes with these bytes, in `bit_exact.rs`.)
    #[test]
    fn each_tile_holds_what_its_rows_encode() {
        let (program, weights, memory) = bound();
        let mut rows_checked = 0;
        for m in &program.matrices {
            let src = MatrixSource::find(&program, m, &weights).unwrap();
            for (ti, t) in m.tiles.iter().enumerate() {
                let (data, scales) = memory.tile(&program, t.region).unwrap();
                let cols = m.columns(t.segments);
                let (f, k) = (m.format, cols.len());
                for i in 0..t.rows.len() {
                    let (w, row) = src.row(t.rows.start + i);
                    let mut want = (vec![0u8; f.data_bytes(k)], vec![0u8; f.scale_bytes(k)]);
                    encode_row(
                        w,
                        row,
                        src.cols,
                        f,
                        cols.start,
                        cols.end,
                        &mut want.0,
                        &mut want.1,
                    );
                    let got =
                        crate::executor::kernel::unpack_row(f, t.rows.len(), k, i, data, scales);
                    assert_eq!(got, want, "{} tile {ti} row {i}", m.name);
                    rows_checked += 1;
                }
                assert!(
                    data.iter().any(|&b| b != 0),
                    "{} tile {ti} is empty",
                    m.name
                );
            }
        }
        assert!(rows_checked > 100, "{rows_checked} rows");
    }
}
