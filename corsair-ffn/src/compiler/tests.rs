//! The compiler's decisions at their edges: what a share that does not fit says, what spilling
//! streams and when it gives up, the LPDDR limit, where tiles are placed, the sizes of layer
//! outputs, proposal buffers and tiles, and the numerics a split dense layer keeps.

use super::*;
use crate::program::{MemoryKind, Op};
use crate::synthetic::tiny_config;
use model::config::FfnKind;
use model::kernels::ActivationDtype;

/// A card of 8 cores of 64 KiB: small enough that a few tiny experts overflow it.
fn small_card() -> HardwareProfile {
    let mut p = HardwareProfile::default();
    let h = &mut p.hierarchy;
    (h.packages, h.chiplets_per_package, h.gangs_per_chiplet) = (1, 1, 1);
    (h.slices_per_gang, h.cores_per_slice) = (1, 8);
    p.memory.sram_bytes = 8 * 64 * 1024;
    p
}

fn options(max_tokens: usize, allow_spill: bool) -> CompileOptions {
    CompileOptions {
        max_tokens,
        allow_spill,
        tiling: tiling::TilingOptions {
            rows_per_tile: Some(16),
            segments_per_tile: None,
        },
        ..CompileOptions::default()
    }
}

/// Each card's share of `cfg` over `cards` cards, one copy of each expert.
fn shares(cfg: &ModelConfig, cards: usize) -> Vec<CardAssignment> {
    let placement = PlacementOptions {
        cards,
        replicas: vec![],
    };
    plan_placement(cfg, &placement).unwrap()
}

/// Four experts of 192 KiB of bf16 weights each, on one card.
fn share() -> (ModelConfig, CardAssignment) {
    let cfg = tiny_config(4, 2, 256, 128, &[FfnKind::Moe]);
    let a = shares(&cfg, 1).remove(0);
    (cfg, a)
}

fn bf16() -> StoredFormats {
    StoredFormats::uniform(TileFormat::Bf16)
}

#[test]
fn a_share_too_large_says_what_it_needs_by_kind_and_what_to_do() {
    let (cfg, a) = share();
    let err = compile(&cfg, &bf16(), &a, &options(4, false), &small_card()).unwrap_err();
    let Error::DoesNotFit(fit) = &err else {
        panic!("{err}")
    };
    assert!(fit.needed_bytes > fit.sram_bytes);
    assert!(!fit.allow_spill);
    let text = fit.to_string();
    assert!(text.starts_with("card 0 of 1 does not fit"), "{text}");
    assert!(text.contains(&human_bytes(fit.sram_bytes)), "{text}");
    // Each kind with bytes is listed; a kind of none is not.
    for u in &fit.needed {
        let part = format!("{} {}", u.kind, human_bytes(u.bytes));
        assert_eq!(text.contains(&part), u.bytes > 0, "{part}: {text}");
    }
    let mut zero = (**fit).clone();
    zero.needed.push(MemoryUse {
        kind: RegionKind::LmHeadWeight,
        bytes: 0,
    });
    assert_eq!(zero.to_string(), text);
    assert!(fit.advice.contains("--allow-spill") && fit.advice.contains("--format mxfp4"));
    assert!(text.ends_with(&fit.advice), "{text}");
    // The advice names a smaller --max-tokens only where the step is large.
    let large = compile(&cfg, &bf16(), &a, &options(65, false), &small_card()).unwrap_err();
    let small = compile(&cfg, &bf16(), &a, &options(64, false), &small_card()).unwrap_err();
    assert!(
        large.to_string().contains("a smaller --max-tokens"),
        "{large}"
    );
    assert!(!small.to_string().contains("--max-tokens"), "{small}");
    // MXFP4 weights are already the smallest format (eight larger experts, to overflow).
    let mx = CompileOptions {
        format: crate::format::FormatChoice::Mxfp4,
        ..options(4, false)
    };
    let cfg = tiny_config(8, 2, 512, 256, &[FfnKind::Moe]);
    let a = shares(&cfg, 1).remove(0);
    match compile(&cfg, &bf16(), &a, &mx, &small_card()) {
        Err(Error::DoesNotFit(fit)) => assert!(!fit.advice.contains("--format"), "{fit}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn spilling_streams_what_does_not_fit_and_gives_up_when_the_pool_alone_is_too_large() {
    let (cfg, a) = share();
    let c = compile(&cfg, &bf16(), &a, &options(4, true), &small_card()).unwrap();
    let experts: Vec<_> = c
        .program
        .matrices
        .iter()
        .filter(|m| !matches!(m.role, MatrixRole::LmHead))
        .collect();
    let streamed = experts.iter().filter(|m| m.streamed).count();
    assert!(
        streamed > 1 && streamed < experts.len(),
        "{streamed} of {}",
        experts.len()
    );
    // SRAM holds what was not streamed.
    let held: u64 = experts
        .iter()
        .filter(|m| !m.streamed)
        .map(|m| m.bytes())
        .sum();
    assert!(held > 0);
    assert_eq!(resident_sram(&c.program, RegionKind::ExpertWeight), held);
    // Activations for 4096 tokens need more than the card's SRAM: spilling every weight does
    // not help, and the error says so instead of failing another way.
    match compile(&cfg, &bf16(), &a, &options(4096, true), &small_card()) {
        Err(Error::DoesNotFit(fit)) => assert!(fit.allow_spill, "{fit}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn lpddr_may_be_filled_to_its_last_byte_and_not_one_past() {
    let (cfg, a) = share();
    let c = compile(&cfg, &bf16(), &a, &options(4, true), &small_card()).unwrap();
    let needed = c
        .program
        .regions
        .iter()
        .filter(|r| r.memory == MemoryKind::Lpddr)
        .map(|r| r.address + r.bytes.next_multiple_of(memory::ALIGN).max(memory::ALIGN))
        .max()
        .unwrap();
    let with_lpddr = |bytes: u64| {
        let mut p = small_card();
        p.memory.lpddr_bytes = bytes;
        compile(&cfg, &bf16(), &a, &options(4, true), &p)
    };
    assert!(with_lpddr(needed).is_ok());
    match with_lpddr(needed - 1) {
        Err(Error::DoesNotFit(fit)) => {
            let says = format!(
                "LPDDR holds {} but the streamed weights need {}",
                human_bytes(needed - 1),
                human_bytes(needed)
            );
            assert!(fit.advice.contains(&says), "{says}: {fit}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_deployment_compiles_one_result_per_card() {
    let cfg = tiny_config(4, 2, 64, 32, &[FfnKind::Moe, FfnKind::Dense]);
    let placement = PlacementOptions {
        cards: 3,
        replicas: vec![],
    };
    let all = compile_deployment(
        &cfg,
        &bf16(),
        &placement,
        &options(4, false),
        &HardwareProfile::default(),
    )
    .unwrap();
    assert_eq!(all.len(), 3);
    for (card, c) in all.iter().enumerate() {
        assert_eq!(c.as_ref().unwrap().program.assignment.card, card);
    }
}

#[test]
fn a_split_dense_layer_rounds_its_inputs_as_the_whole_layer_does() {
    // The dense layer's 80 columns are not a whole number of 32-element blocks, so the whole
    // layer's products keep f32 inputs; a card's share of them may be whole blocks, and must
    // still keep f32 (as the reference, which computes the whole layer, does).
    let cfg = tiny_config(4, 2, 64, 40, &[FfnKind::Dense, FfnKind::Moe]);
    let o = CompileOptions {
        activations: ActivationDtype::Bf16,
        ..options(4, false)
    };
    let mut block_aligned = 0;
    for a in shares(&cfg, 2) {
        let c = compile(&cfg, &bf16(), &a, &o, &HardwareProfile::default()).unwrap();
        let matrix = |name: &str| c.program.matrices.iter().find(|m| m.name == name).unwrap();
        let m = matrix("L0.dense.down");
        assert_eq!(
            m.activations,
            ActivationDtype::F32,
            "card {}: {} columns",
            a.card,
            m.cols
        );
        block_aligned += usize::from(m.cols % 32 == 0);
        // The gate and up projections reduce over the hidden size (64): whole blocks.
        assert_eq!(
            matrix("L0.dense.gate_up").activations,
            ActivationDtype::Bf16
        );
    }
    assert!(
        block_aligned > 0,
        "no card's share is whole blocks: the test shows nothing"
    );
}

#[test]
fn weight_tiles_are_dealt_round_robin_and_streamed_tiles_spread_over_the_cores() {
    let (cfg, a) = share();
    let c = compile(&cfg, &bf16(), &a, &options(4, true), &small_card()).unwrap();
    let p = &c.program;
    let weight_cores = (p.pool_base / p.profile.core_bytes()) as usize;
    assert!(weight_cores > 1, "{weight_cores}");
    // The first matrix's tiles go to core 0, 1, 2, ... in turn (they are small).
    let first = &p.matrices[0];
    assert!(!first.streamed && first.tiles.len() > weight_cores);
    for (i, t) in first.tiles.iter().enumerate() {
        assert_eq!(t.core as usize, i % weight_cores, "tile {i}");
        let r = &p.regions[t.region as usize];
        assert_eq!(
            (r.address / p.profile.core_bytes()) as usize,
            i % weight_cores
        );
    }
    // Streamed tiles (the LM head's, here) run on consecutive cores, not all on one.
    let head = p
        .matrices
        .iter()
        .find(|m| m.role == MatrixRole::LmHead)
        .unwrap();
    assert!(head.streamed && head.tiles.len() > 1);
    let cores: Vec<u32> = head.tiles.iter().map(|t| t.core).collect();
    let cores_total = p.profile.hierarchy.cores() as u32;
    for w in cores.windows(2) {
        assert_eq!(w[1], (w[0] + 1) % cores_total, "{cores:?}");
    }
}

#[test]
fn every_layer_answers_full_rows_and_the_proposal_buffer_holds_every_candidate() {
    // Three cards over a dense layer of 64 columns: one card holds none of them and still
    // answers (zeros) as wide as the others.
    let cfg = tiny_config(4, 2, 64, 32, &[FfnKind::Dense, FfnKind::Moe]);
    for (max_tokens, candidates) in [(4, 64), (3, 5)] {
        for a in shares(&cfg, 3) {
            let o = CompileOptions {
                candidates,
                ..options(max_tokens, false)
            };
            let c = compile(&cfg, &bf16(), &a, &o, &HardwareProfile::default()).unwrap();
            let p = &c.program;
            for l in &p.layers {
                let bytes = p.regions[l.output as usize].bytes;
                assert_eq!(bytes, (max_tokens * 64 * 4) as u64, "card {}", a.card);
            }
            let lm = p.lm_head.as_ref().unwrap();
            let head = &p.matrices[lm.matrix as usize];
            assert!(
                head.tiles
                    .iter()
                    .all(|t| { p.regions[t.region as usize].kind == RegionKind::LmHeadWeight })
            );
            let Some(Op::Propose { out, .. }) = p
                .instructions
                .iter()
                .find(|op| matches!(op, Op::Propose { .. }))
            else {
                panic!("no proposal")
            };
            // Per token: the fixed words, then (logit, token) per candidate.
            let per_token = p.regions[*out as usize].bytes as usize / max_tokens;
            assert_eq!(
                per_token,
                PROPOSAL_FIXED_BYTES as usize + 8 * candidates,
                "card {}",
                a.card
            );
        }
    }
    let empty = shares(&cfg, 3)
        .iter()
        .any(|a| matches!(a.layers[0], LayerShare::Dense { columns } if columns.is_empty()));
    assert!(
        empty,
        "no card lacks dense columns: the zero answer is not tested"
    );
}

#[test]
fn a_tile_past_the_first_segment_holds_exactly_its_columns() {
    // 1100 columns: segments of 512, 512 and 76; one segment a tile.
    let cfg = tiny_config(2, 1, 1100, 64, &[FfnKind::Moe]);
    let o = CompileOptions {
        tiling: tiling::TilingOptions {
            rows_per_tile: Some(16),
            segments_per_tile: Some(1),
        },
        ..options(4, false)
    };
    let a = shares(&cfg, 1).remove(0);
    let c = compile(&cfg, &bf16(), &a, &o, &HardwareProfile::default()).unwrap();
    let up = &c.program.matrices[0];
    assert_eq!(up.segments(), 3);
    for t in &up.tiles {
        let cols = up.columns(t.segments).len();
        assert_eq!(cols, [512, 512, 76][t.segments.start]);
        let bytes = c.program.regions[t.region as usize].bytes;
        assert_eq!(bytes, (t.rows.len() * up.format.row_bytes(cols)) as u64);
    }
}

#[test]
fn spilling_streams_the_fewest_matrices_in_order_that_cover_the_deficit() {
    let (cfg, a) = share();
    let o = options(4, false);
    // The share placed on a large card: every weight in SRAM, beside its transient pool.
    let c = compile(&cfg, &bf16(), &a, &o, &HardwareProfile::default()).unwrap();
    let small = small_card();
    let layers = tiling::ffn_matrices(
        &cfg,
        &a,
        (TileFormat::Bf16, TileFormat::Bf16),
        &bf16(),
        &o.tiling,
        &small,
    )
    .unwrap();
    let order: Vec<(usize, usize)> = (0..layers[0].len()).map(|r| (0, r)).collect();
    let pool_cores = c.program.pool_bytes.div_ceil(small.core_bytes()) as usize;
    let capacity = small.core_bytes() * (small.hierarchy.cores() - pool_cores) as u64;
    // Only resident SRAM counts: weights, not the pool nor what LPDDR holds.
    let resident: u64 = c
        .program
        .regions
        .iter()
        .filter(|r| r.kind.is_resident() && r.memory == MemoryKind::Sram)
        .map(|r| r.bytes.next_multiple_of(memory::ALIGN))
        .sum();
    assert!(resident > capacity);
    let mut covered = 0;
    let fewest = 1 + order
        .iter()
        .position(|&(l, r)| {
            covered += layers[l][r].bytes();
            covered >= resident - capacity
        })
        .unwrap();
    assert!(fewest > 1 && fewest < order.len(), "{fewest}");
    assert_eq!(
        next_spill(&c.program, &layers, &order, 0, &small, pool_cores),
        fewest
    );
    // From a later start, the count goes on from there; and never past the end.
    assert!(next_spill(&c.program, &layers, &order, 1, &small, pool_cores) >= fewest);
    let last = order.len() - 1;
    assert_eq!(
        next_spill(&c.program, &layers, &order, last, &small, pool_cores),
        order.len()
    );
}
