//! Each kind of bug injected into a valid program is caught and named.

mod edges;

use super::*;
use crate::assignment::{PlacementOptions, plan_placement};
use crate::compiler::{CompileOptions, StoredFormats, compile};
use crate::format::TileFormat;
use crate::profile::HardwareProfile;
use crate::program::{Program, RegionKind};
use crate::synthetic::tiny_config;
use model::config::FfnKind;

fn valid() -> Program {
    let cfg = tiny_config(4, 2, 96, 64, &[FfnKind::Moe, FfnKind::Dense, FfnKind::Moe]);
    let tiling = crate::compiler::TilingOptions {
        rows_per_tile: Some(16),
        segments_per_tile: None,
    };
    first_card(&cfg, 2, tiling, &HardwareProfile::default())
}

/// The program of card 0 of `cards` (bf16 weights, 4 tokens a step), proven clean.
fn first_card(
    cfg: &model::ModelConfig,
    cards: usize,
    tiling: crate::compiler::TilingOptions,
    profile: &HardwareProfile,
) -> Program {
    let placement = PlacementOptions {
        cards,
        replicas: vec![],
    };
    let plan = plan_placement(cfg, &placement).unwrap();
    let options = CompileOptions {
        max_tokens: 4,
        tiling,
        ..CompileOptions::default()
    };
    let formats = StoredFormats::uniform(TileFormat::Bf16);
    let c = compile(cfg, &formats, &plan[0], &options, profile).unwrap();
    assert!(c.sanitizer.is_clean(), "{:#?}", c.sanitizer.findings);
    c.program
}

fn region(p: &Program, name: &str) -> RegionId {
    p.regions
        .iter()
        .position(|r| r.name == name)
        .unwrap_or_else(|| panic!("no region {name}")) as RegionId
}

fn op_index(p: &Program, f: impl Fn(&Op) -> bool) -> usize {
    p.instructions.iter().position(f).unwrap()
}

fn kinds(p: &Program) -> Vec<FindingKind> {
    sanitize(p).findings.iter().map(|f| f.kind).collect()
}

#[track_caller]
fn assert_caught(p: &Program, kind: FindingKind) {
    let report = sanitize(p);
    assert!(
        report.findings.iter().any(|f| f.kind == kind),
        "expected {kind:?}, got {:#?}",
        report.findings
    );
    // Every finding names what it is about.
    assert!(report.findings.iter().all(|f| !f.to_string().is_empty()));
}

#[test]
fn a_valid_program_is_clean_and_fully_checked() {
    let p = valid();
    let r = sanitize(&p);
    assert!(r.is_clean(), "{:#?}", r.findings);
    assert_eq!(r.instructions, p.instructions.len());
    assert!(r.accesses > p.instructions.len());
    let bytes: u64 = (0..p.instructions.len())
        .flat_map(|i| p.accesses(i).accesses)
        .map(|a| a.end - a.start)
        .sum();
    assert_eq!(r.bytes_accessed, bytes);
}

#[test]
fn two_tiles_writing_the_same_partials_conflict() {
    let mut p = valid();
    let i = op_index(
        &p,
        |op| matches!(op, Op::MatMul { tiles, .. } if tiles.len() > 1),
    );
    if let Op::MatMul { tiles, .. } = &mut p.instructions[i] {
        tiles[1].partial_offset = tiles[0].partial_offset;
    }
    assert_caught(&p, FindingKind::ConflictingWrite);
}

#[test]
fn overwriting_unread_results_conflicts() {
    let mut p = valid();
    // Replace the first Scale (which reads the expert's output) with a fill of that output:
    // the reduce's result is overwritten before anyone read it.
    let i = op_index(&p, |op| matches!(op, Op::Scale { .. }));
    let Op::Scale { values, .. } = p.instructions[i] else {
        unreachable!()
    };
    p.instructions[i] = Op::Fill { region: values };
    assert_caught(&p, FindingKind::ConflictingWrite);
}

#[test]
fn writing_resident_weights_conflicts() {
    let mut p = valid();
    let tile = p.matrices[0].tiles[0].region;
    let i = op_index(&p, |op| matches!(op, Op::Scale { .. }));
    if let Op::Scale { values, .. } = &mut p.instructions[i] {
        *values = tile;
    }
    assert_caught(&p, FindingKind::ConflictingWrite);
}

#[test]
fn reading_before_the_producer_runs_is_caught() {
    let mut p = valid();
    // Swap the activation with the down-projection matmul that reads its output.
    let i = op_index(&p, |op| matches!(op, Op::Activate { .. }));
    p.instructions.swap(i, i + 1);
    // The swapped matmul's reduce must still name it.
    if let Op::Reduce { matmul, .. } = &mut p.instructions[i + 2] {
        *matmul = i as u32;
    }
    assert_caught(&p, FindingKind::UninitializedRead);
}

#[test]
fn a_removed_producer_is_missing() {
    let mut p = valid();
    let i = op_index(&p, |op| matches!(op, Op::Gather { .. }));
    let Op::Gather { map, rows, .. } = p.instructions[i] else {
        unreachable!()
    };
    p.instructions[i] = Op::Fill { region: map };
    assert_caught(&p, FindingKind::MissingProducer);
    // The gathered rows have no producer left: said by the region's name, not its number.
    let name = &p.regions[rows as usize].name;
    let says = format!("reads {name} but no instruction writes it");
    assert!(
        sanitize(&p).findings.iter().any(|f| f.detail == says),
        "{says}: {:#?}",
        sanitize(&p).findings
    );
}

#[test]
fn a_dropped_tile_leaves_an_incomplete_producer() {
    let mut p = valid();
    let i = op_index(
        &p,
        |op| matches!(op, Op::MatMul { tiles, .. } if tiles.len() > 1),
    );
    if let Op::MatMul { tiles, .. } = &mut p.instructions[i] {
        tiles.remove(0);
    }
    assert_caught(&p, FindingKind::IncompleteProducer);
}

#[test]
fn a_short_producer_is_incomplete() {
    let mut p = valid();
    // The layer-0 output is produced for fewer bytes than Send reads: shrink SumSlots' view by
    // pointing it at a smaller region of the same layer is not possible, so grow the output
    // region instead: Send reads all of it, SumSlots writes only the rows.
    let out = region(&p, "L0.out");
    p.regions[out as usize].bytes += 64;
    assert_caught(&p, FindingKind::IncompleteProducer);
}

#[test]
fn overlapping_live_buffers_are_caught() {
    let mut p = valid();
    let a = region(&p, "L0.e0.gate_up_out");
    let b = region(&p, "L0.e0.act");
    let addr = p.regions[a as usize].address;
    p.regions[b as usize].address = addr;
    p.regions[b as usize].location = p.profile.locate(addr);
    assert_caught(&p, FindingKind::LiveOverlap);
}

#[test]
fn an_access_outside_the_declared_lifetime_is_caught() {
    let mut p = valid();
    let r = region(&p, "L0.x");
    p.regions[r as usize].lifetime = Lifetime::Transient { first: 0, last: 0 };
    assert_caught(&p, FindingKind::OutsideLifetime);
}

#[test]
fn regions_past_the_end_of_sram_overflow() {
    let mut p = valid();
    let tile = p.matrices[0].tiles[0].region as usize;
    let addr = p.profile.memory.sram_bytes - 16;
    p.regions[tile].address = addr;
    p.regions[tile].location = p.profile.locate(addr);
    assert_caught(&p, FindingKind::CapacityOverflow);
}

#[test]
fn a_tile_across_two_cores_overflows() {
    let mut p = valid();
    let tile = p.matrices[0].tiles[0].region as usize;
    let addr = p.profile.core_bytes() * 5 - 64;
    p.regions[tile].address = addr;
    p.regions[tile].location = p.profile.locate(addr);
    assert_caught(&p, FindingKind::CapacityOverflow);
}

#[test]
fn reads_past_a_region_are_out_of_bounds() {
    let mut p = valid();
    let x = region(&p, "L0.x");
    p.regions[x as usize].bytes = 4;
    assert_caught(&p, FindingKind::OutOfBounds);
}

#[test]
fn a_wrong_placement_record_is_out_of_bounds() {
    let mut p = valid();
    let tile = p.matrices[0].tiles[0].region as usize;
    if let Some(loc) = &mut p.regions[tile].location {
        loc.core = 999;
    }
    assert_caught(&p, FindingKind::OutOfBounds);
}

#[test]
fn unknown_regions_are_out_of_bounds() {
    let mut p = valid();
    let i = op_index(&p, |op| matches!(op, Op::Send { .. }));
    p.instructions[i] = Op::Send { src: 1_000_000 };
    assert_caught(&p, FindingKind::OutOfBounds);
}

#[test]
fn references_to_missing_matrices_tiles_and_matmuls_are_named() {
    let p = valid();
    let mm = op_index(&p, |op| matches!(op, Op::MatMul { .. }));
    let mut q = p.clone();
    if let Op::MatMul { matrix, .. } = &mut q.instructions[mm] {
        *matrix = 777;
    }
    let mut r = p.clone();
    if let Op::MatMul { tiles, .. } = &mut r.instructions[mm] {
        tiles[0].tile = 555;
    }
    let red = op_index(&p, |op| matches!(op, Op::Reduce { .. }));
    let mut t = p.clone();
    if let Op::Reduce { matmul, .. } = &mut t.instructions[red] {
        *matmul = red as u32;
    }
    for (program, says) in [
        (q, "matrix 777, which does not exist"),
        (r, "tile 555 of matrix"),
        (t, "as its matmul, which is not one"),
    ] {
        let report = sanitize(&program);
        assert!(
            report
                .findings
                .iter()
                .any(|f| f.kind == FindingKind::OutOfBounds && f.detail.contains(says)),
            "{says}: {:?}",
            report.findings
        );
    }
}

#[test]
fn weights_never_share_memory_with_the_pool() {
    let p = valid();
    let pool = p
        .regions
        .iter()
        .filter(|r| r.kind == RegionKind::Partial)
        .map(|r| r.address)
        .min()
        .unwrap();
    assert!(pool >= p.pool_base);
    let mut q = p.clone();
    let tile = q.matrices[0].tiles[0].region as usize;
    q.regions[tile].address = pool;
    q.regions[tile].location = q.profile.locate(pool);
    assert!(kinds(&q).contains(&FindingKind::LiveOverlap));
}

#[test]
fn every_kind_reads_as_its_own_words_and_a_finding_makes_a_report_unclean() {
    let all = [
        FindingKind::ConflictingWrite,
        FindingKind::UninitializedRead,
        FindingKind::MissingProducer,
        FindingKind::IncompleteProducer,
        FindingKind::LiveOverlap,
        FindingKind::OutsideLifetime,
        FindingKind::CapacityOverflow,
        FindingKind::OutOfBounds,
    ];
    let words: std::collections::HashSet<String> = all.iter().map(|k| k.to_string()).collect();
    assert_eq!(words.len(), all.len(), "{words:?}");
    assert_eq!(FindingKind::OutOfBounds.to_string(), "out of bounds");
    let mut p = valid();
    let x = region(&p, "L0.x");
    p.regions[x as usize].bytes = 4;
    let report = sanitize(&p);
    assert!(!report.is_clean());
    // A finding says what it is, and which region by name.
    let f = &report.findings[0];
    assert!(f.to_string().contains(&f.kind.to_string()), "{f}");
    assert!(
        report.findings.iter().any(|f| f.detail.contains("L0.x")),
        "{:#?}",
        report.findings
    );
}

#[test]
fn a_layer_whose_instructions_lie_outside_the_stream_is_out_of_bounds() {
    let p = valid();
    let len = p.instructions.len();
    for span in [Span::new(len - 1, len + 1), Span::new(3, 2)] {
        let mut q = p.clone();
        q.layers[0].instructions = span;
        let report = sanitize(&q);
        assert!(
            report
                .findings
                .iter()
                .any(|f| f.kind == FindingKind::OutOfBounds
                    && f.detail.contains("outside the stream")),
            "{span}: {:#?}",
            report.findings
        );
    }
    // An empty span is inside (its instructions then belong to no layer, which is another
    // finding).
    let mut q = p.clone();
    let start = q.layers[0].instructions.start;
    q.layers[0].instructions = Span::new(start, start);
    let findings = sanitize(&q).findings;
    assert!(
        !findings
            .iter()
            .any(|f| f.detail.contains("outside the stream")),
        "{findings:#?}"
    );
    assert!(
        findings
            .iter()
            .any(|f| f.detail.contains("belongs to no layer"))
    );
}

#[test]
fn a_region_may_end_exactly_at_the_end_of_sram_or_of_a_core() {
    let p = valid();
    let tile = p.matrices[0].tiles[0].region as usize;
    let bytes = p.regions[tile].bytes;
    let overflows = |address: u64| {
        let mut q = p.clone();
        q.regions[tile].address = address;
        q.regions[tile].location = q.profile.locate(address);
        kinds(&q).contains(&FindingKind::CapacityOverflow)
    };
    let sram = p.profile.memory.sram_bytes;
    assert!(!overflows(sram - bytes), "ending at the last byte of SRAM");
    assert!(overflows(sram - bytes + 1), "one byte past it");
    let core = p.profile.core_bytes();
    assert!(
        !overflows(core * 5 - bytes),
        "ending at the last byte of core 4"
    );
    assert!(overflows(core * 5 - bytes + 1), "one byte into core 5");
}

/// Adds a region of no bytes at `address`, a resident weight tile in every other way.
fn push_empty_resident_region(p: &mut Program, address: u64) {
    let tile = p.matrices[0].tiles[0].region as usize;
    let mut empty = p.regions[tile].clone();
    assert!(empty.kind.is_resident());
    empty.name = "empty".into();
    empty.bytes = 0;
    empty.address = address;
    empty.location = p.profile.locate(address);
    p.regions.push(empty);
}

#[test]
fn an_empty_resident_region_at_the_start_of_a_core_straddles_nothing() {
    let mut p = valid();
    let address = p.profile.core_bytes() * 5;
    push_empty_resident_region(&mut p, address);
    assert!(
        !kinds(&p).contains(&FindingKind::CapacityOverflow),
        "{:#?}",
        sanitize(&p).findings
    );
}

#[test]
fn a_tile_region_smaller_than_its_tile_overflows_and_a_larger_one_does_not() {
    let p = valid();
    let tile = p.matrices[0].tiles[0].region as usize;
    let says = |bytes: u64| {
        let mut q = p.clone();
        q.regions[tile].bytes = bytes;
        sanitize(&q)
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::CapacityOverflow && f.detail.contains("its tile needs"))
    };
    let bytes = p.regions[tile].bytes;
    assert!(says(bytes - 1));
    assert!(!says(bytes));
    assert!(!says(bytes + 64));
}

#[test]
fn an_access_may_end_exactly_at_its_regions_end() {
    let p = valid();
    let x = region(&p, "L0.x");
    let end = (0..p.instructions.len())
        .flat_map(|i| p.accesses(i).accesses)
        .filter(|a| a.region == x)
        .map(|a| a.end)
        .max()
        .expect("L0.x is accessed");
    let out_of_bounds = |bytes: u64| {
        let mut q = p.clone();
        q.regions[x as usize].bytes = bytes;
        sanitize(&q)
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::OutOfBounds && f.region == Some(x))
    };
    assert!(
        !out_of_bounds(end),
        "the last access ends at the region's end"
    );
    assert!(out_of_bounds(end - 1));
}
