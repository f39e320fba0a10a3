//! The edges of each check: the exact finding a bug gets (kind, bytes, rows, segments), and
//! the neighbouring valid program that gets none.

use super::*;
use crate::compiler::TilingOptions;
use crate::program::{Access, MatrixRole};

/// A program whose up-projections have two reduction segments a row band (hidden 1024, one
/// segment a tile) and whose LM head streams in one chunk per row band.
fn segmented() -> Program {
    let cfg = tiny_config(2, 1, 1024, 64, &[FfnKind::Moe]);
    let mut profile = HardwareProfile::default();
    profile.compiler.lm_head_chunk_bytes = 1;
    let tiling = TilingOptions {
        rows_per_tile: Some(16),
        segments_per_tile: Some(1),
    };
    first_card(&cfg, 1, tiling, &profile)
}

fn details(p: &Program, kind: FindingKind) -> Vec<String> {
    sanitize(p)
        .findings
        .into_iter()
        .filter(|f| f.kind == kind)
        .map(|f| f.detail)
        .collect()
}

/// The first matmul running at least two tiles, and its partial writes in tile order.
fn multi_tile_matmul(p: &Program) -> (usize, Vec<Access>) {
    let i = op_index(
        p,
        |op| matches!(op, Op::MatMul { tiles, .. } if tiles.len() > 1),
    );
    let Op::MatMul { partials, .. } = p.instructions[i] else {
        unreachable!()
    };
    let writes = p
        .accesses(i)
        .accesses
        .into_iter()
        .filter(|a| a.write && a.region == partials)
        .collect();
    (i, writes)
}

#[test]
fn two_writes_of_one_instruction_that_share_bytes_are_named_with_the_bytes() {
    let mut p = valid();
    let (i, w) = multi_tile_matmul(&p);
    assert!(w[0].end - w[0].start > 4 && w[1].end - w[1].start > 4);
    // The second tile's partials start 4 bytes before the first's end.
    let at = w[0].end - 4;
    if let Op::MatMul { tiles, .. } = &mut p.instructions[i] {
        tiles[1].partial_offset = at;
    }
    let name = &p.regions[w[0].region as usize].name;
    let says = format!(
        "two writes of {name} in one instruction overlap at {at:#x}..{:#x}",
        w[0].end
    );
    let found = details(&p, FindingKind::ConflictingWrite);
    assert!(found.contains(&says), "{says}: {found:#?}");
}

#[test]
fn writes_of_one_instruction_that_only_touch_do_not_conflict() {
    let mut p = valid();
    let (i, w) = multi_tile_matmul(&p);
    // Two tiles of one shape trade places: the later write now ends where the earlier begins.
    assert_eq!(w[0].end - w[0].start, w[1].end - w[1].start);
    assert_eq!(w[0].end, w[1].start, "the compiler packs partials");
    if let Op::MatMul { tiles, .. } = &mut p.instructions[i] {
        let (a, b) = (tiles[0].partial_offset, tiles[1].partial_offset);
        tiles[0].partial_offset = b;
        tiles[1].partial_offset = a;
    }
    let report = sanitize(&p);
    assert!(report.is_clean(), "{:#?}", report.findings);
}

#[test]
fn an_access_of_no_bytes_is_inside_its_region() {
    let mut p = valid();
    let i = op_index(&p, |op| matches!(op, Op::Activate { .. }));
    if let Op::Activate { width, .. } = &mut p.instructions[i] {
        *width = 0;
    }
    assert!(
        p.accesses(i)
            .accesses
            .iter()
            .all(|a| a.start == 0 && a.end == 0)
    );
    // The activation's readers now find nothing written; but nothing is out of bounds.
    let out = details(&p, FindingKind::OutOfBounds);
    assert!(out.is_empty(), "{out:#?}");
    assert!(!sanitize(&p).is_clean());
}

/// The matrix and tile index of the first row band after the first, in a matrix of several.
fn second_band(p: &Program) -> (usize, usize) {
    for (mi, m) in p.matrices.iter().enumerate() {
        if let Some(k) = m.tiles.iter().position(|t| t.rows.start > 0) {
            return (mi, k);
        }
    }
    panic!("no matrix has two row bands")
}

#[test]
fn rows_in_two_tiles_are_named() {
    let mut p = valid();
    let (mi, k) = second_band(&p);
    let rows = p.matrices[mi].tiles[k].rows;
    // The second band starts half way into the first.
    let start = rows.start - 8;
    p.matrices[mi].tiles[k].rows = crate::assignment::Span::new(start, rows.end - 8);
    let says = format!(
        "rows {start}..{} of {} are in two tiles",
        rows.start, p.matrices[mi].name
    );
    let found = details(&p, FindingKind::ConflictingWrite);
    assert!(found.contains(&says), "{says}: {found:#?}");
}

/// The first tile of a band cut into several segments, and the band's second tile.
fn segmented_band(p: &Program) -> (usize, usize) {
    for (mi, m) in p.matrices.iter().enumerate() {
        if m.segments() > 1 && m.role != MatrixRole::LmHead {
            let k = m.tiles.iter().position(|t| t.segments.start == 1).unwrap();
            assert_eq!(m.tiles[k - 1].rows, m.tiles[k].rows);
            return (mi, k);
        }
    }
    panic!("no matrix has two segments")
}

#[test]
fn a_segment_gap_and_a_segment_in_two_tiles_are_named() {
    let p = segmented();
    let (mi, k) = segmented_band(&p);
    let m = &p.matrices[mi];
    let rows = m.tiles[k].rows;
    let seg = |s: usize, e: usize| crate::assignment::Span::new(s, e);

    // The band's first tile starts at segment 1: segment 0 has no tile (and 1 is in two).
    let mut gap = p.clone();
    gap.matrices[mi].tiles[k - 1].segments = seg(1, 2);
    let says = format!("rows {rows}, segments 0..1 of {} have no tile", m.name);
    let found = details(&gap, FindingKind::IncompleteProducer);
    assert!(found.contains(&says), "{says}: {found:#?}");

    // The band's second tile covers both segments: segment 0 is in two tiles.
    let mut twice = p.clone();
    twice.matrices[mi].tiles[k].segments = seg(0, 2);
    let says = format!("rows {rows}, segment 0 of {} is in two tiles", m.name);
    let found = details(&twice, FindingKind::ConflictingWrite);
    assert!(found.contains(&says), "{says}: {found:#?}");
}

#[test]
fn an_lm_head_reduced_in_chunks_is_clean_and_a_chunk_twice_or_never_is_named() {
    let p = segmented();
    let head = p
        .matrices
        .iter()
        .position(|m| m.role == MatrixRole::LmHead)
        .unwrap();
    let chunks = p
        .instructions
        .iter()
        .filter(|op| {
            matches!(
                op,
                Op::Reduce {
                    layout: crate::program::OutLayout::RowMajor,
                    ..
                }
            )
        })
        .count();
    let mut bands: Vec<_> = p.matrices[head].tiles.iter().map(|t| t.rows).collect();
    bands.dedup();
    let bands = bands.len();
    assert!(
        chunks >= 3 && chunks == bands,
        "{chunks} chunks of {bands} bands"
    );
    // Each chunk reduces only its own rows: that is no gap.
    assert!(sanitize(&p).is_clean());

    // The second band's tiles claim the first band's rows: those are reduced twice and the
    // second band's never.
    let mut q = p.clone();
    let first = q.matrices[head].tiles[0].rows;
    let second = q.matrices[head]
        .tiles
        .iter()
        .map(|t| t.rows)
        .find(|&r| r != first)
        .unwrap();
    for t in &mut q.matrices[head].tiles {
        if t.rows == second {
            t.rows = first;
        }
    }
    let name = &q.matrices[head].name;
    let twice = format!(
        "{name}: rows {}..{} are reduced 2 times",
        first.start, first.end
    );
    let never = format!(
        "{name}: rows {}..{} are reduced 0 times",
        second.start, second.end
    );
    assert!(
        details(&q, FindingKind::ConflictingWrite).contains(&twice),
        "{twice}: {:#?}",
        sanitize(&q).findings
    );
    assert!(
        details(&q, FindingKind::IncompleteProducer).contains(&never),
        "{never}: {:#?}",
        sanitize(&q).findings
    );
}

#[test]
fn an_empty_region_shares_memory_with_nothing() {
    // At the first tile's own address: were it counted, the two would share memory.
    let mut p = valid();
    let address = p.regions[p.matrices[0].tiles[0].region as usize].address;
    push_empty_resident_region(&mut p, address);
    let found = details(&p, FindingKind::LiveOverlap);
    assert!(found.is_empty(), "{found:#?}");
}

#[test]
fn overlaps_are_reported_up_to_a_hundred() {
    let stack = |n: usize| {
        let mut p = valid();
        // Tiles of one size in one memory: stacked on the first, they reach nothing else.
        let first = &p.regions[p.matrices[0].tiles[0].region as usize];
        let (bytes, memory) = (first.bytes, first.memory);
        let tiles: Vec<usize> = p
            .matrices
            .iter()
            .flat_map(|m| m.tiles.iter().map(|t| t.region as usize))
            .filter(|&t| p.regions[t].bytes == bytes && p.regions[t].memory == memory)
            .take(n)
            .collect();
        assert_eq!(tiles.len(), n, "the program has {} tiles", tiles.len());
        let address = p.regions[tiles[0]].address;
        for &t in &tiles {
            p.regions[t].address = address;
            p.regions[t].location = p.profile.locate(address);
        }
        details(&p, FindingKind::LiveOverlap).len()
    };
    // Resident tiles are always live: n at one address overlap pairwise.
    assert_eq!(stack(5), 10);
    assert_eq!(stack(14), 91);
    assert_eq!(stack(15), 100);
    assert_eq!(stack(16), 100, "120 pairs, capped");
}
