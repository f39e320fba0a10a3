//! The performance model against times worked out by hand from the profile's figures, on a
//! small hand-built program that touches every level the model knows: the host link (receive,
//! send), SRAM (gathers; resident tiles read at a core's share of the SRAM bandwidth), LPDDR
//! (streamed tiles), the on-card fabric (a matmul's broadcast, a reduce's partial sums), the
//! arithmetic rate of each weight format, and the vector units.
//!
//! The expected figures below are written out from the profile's fields and the program's
//! shapes; none of them comes from the functions under test.

use super::*;
use crate::assignment::{CardAssignment, LayerShare, Span};
use crate::format::TileFormat;
use crate::profile::HardwareProfile;
use crate::program::{
    ActivationSpec, LayerKind, LayerProgram, Lifetime, LmHeadProgram, Matrix, MatrixRole,
    MemoryKind, OutLayout, Region, RegionId, RegionKind, Tile, TileRun,
};

const HIDDEN: usize = 64;
const TOP_K: usize = 2;
const EXPERTS: usize = 4;
const MAX_TOKENS: usize = 8;
/// Intermediate width of the experts.
const WIDTH: usize = 32;
/// Vocabulary rows of the card's LM-head shard.
const VOCAB_ROWS: usize = 16;

/// Regions and matrices of the program under construction.
struct Parts {
    regions: Vec<Region>,
    matrices: Vec<Matrix>,
}

impl Parts {
    fn region(&mut self, kind: RegionKind, memory: MemoryKind, bytes: u64) -> RegionId {
        self.regions.push(Region {
            name: format!("r{}", self.regions.len()),
            kind,
            memory,
            address: 0,
            bytes,
            location: None,
            lifetime: if kind.is_resident() {
                Lifetime::Resident
            } else {
                Lifetime::Transient { first: 0, last: 0 }
            },
        });
        (self.regions.len() - 1) as RegionId
    }

    /// A matrix `[rows, cols]` cut into row bands `bands` (one segment each: `cols` <= 512),
    /// band `i` computed on core `cores[i]`; its tiles in LPDDR when `streamed`.
    fn matrix(
        &mut self,
        role: MatrixRole,
        (rows, cols): (usize, usize),
        format: TileFormat,
        bands: &[(usize, usize, u32)],
        streamed: bool,
    ) -> u32 {
        let (kind, memory) = match (role, streamed) {
            (MatrixRole::LmHead, _) => (RegionKind::LmHeadWeight, MemoryKind::Lpddr),
            (_, true) => (RegionKind::ExpertWeight, MemoryKind::Lpddr),
            (_, false) => (RegionKind::ExpertWeight, MemoryKind::Sram),
        };
        let tiles = bands
            .iter()
            .map(|&(start, end, core)| Tile {
                region: self.region(
                    kind,
                    memory,
                    ((end - start) * format.row_bytes(cols)) as u64,
                ),
                rows: Span::new(start, end),
                segments: Span::new(0, 1),
                core,
            })
            .collect();
        self.matrices.push(Matrix {
            name: format!("m{}", self.matrices.len()),
            role,
            rows,
            cols,
            format,
            source_format: format,
            tiles,
            bias: None,
            streamed,
            activations: Default::default(),
        });
        (self.matrices.len() - 1) as u32
    }

    fn act(&mut self, bytes: usize) -> RegionId {
        self.region(RegionKind::Activation, MemoryKind::Sram, bytes as u64)
    }
}

/// Runs of every tile of matrix `m`, reading from their own regions or from `staging`.
fn runs(parts: &Parts, m: u32, staging: Option<RegionId>) -> Vec<TileRun> {
    parts.matrices[m as usize]
        .tiles
        .iter()
        .enumerate()
        .map(|(i, t)| TileRun {
            tile: i as u32,
            weights: staging.unwrap_or(t.region),
            weights_offset: 0,
            partial_offset: 0,
        })
        .collect()
}

/// A matmul of matrix `m` from `input` into `partials`, and the reduce of those into `out`.
fn push_matmul(
    ops: &mut Vec<Op>,
    m: u32,
    rows: RowCount,
    (input, partials, out): (RegionId, RegionId, RegionId),
    tiles: Vec<TileRun>,
    layout: OutLayout,
) {
    ops.push(Op::MatMul {
        matrix: m,
        rows,
        input,
        partials,
        tiles,
    });
    ops.push(Op::Reduce {
        matmul: (ops.len() - 1) as u32,
        out,
        layout,
    });
}

/// The hand-built program. Layer 0 (MoE) holds experts 1 and 3: expert 1's weights are
/// resident in SRAM (gate_up bf16 in three tiles, two on core 0 and one on core 1; down MXFP4
/// in one tile), expert 3's are spilled to LPDDR and streamed in (bf16, one tile per matrix).
/// Layer 1 is an empty dense slice. The LM head holds 16 vocabulary rows, streamed.
///
/// Instruction indices: 0 receive, 1 gather e1, 2 gate_up e1, 3 reduce, 4 activate,
/// 5 down e1, 6 reduce, 7 scale, 8 gather e3, 9 stream gate_up e3, 10 gate_up e3, 11 reduce,
/// 12 activate, 13 stream down e3, 14 down e3, 15 reduce, 16 scale, 17 sum slots, 18 send;
/// 19 receive, 20 fill, 21 send; 22 receive, 23 stream, 24 LM-head matmul, 25 reduce,
/// 26 propose, 27 send.
fn program() -> Program {
    let (h, n) = (HIDDEN, MAX_TOKENS);
    let mut p = Parts {
        regions: Vec::new(),
        matrices: Vec::new(),
    };
    let gate_up = |expert| MatrixRole::GateUp {
        layer: 0,
        expert: Some(expert),
    };
    let down = |expert| MatrixRole::Down {
        layer: 0,
        expert: Some(expert),
    };
    let e1_gate_up = p.matrix(
        gate_up(1),
        (2 * WIDTH, h),
        TileFormat::Bf16,
        &[(0, 16, 0), (16, 48, 0), (48, 64, 1)],
        false,
    );
    let e1_down = p.matrix(down(1), (h, WIDTH), TileFormat::Mxfp4, &[(0, 64, 1)], false);
    let e3_gate_up = p.matrix(
        gate_up(3),
        (2 * WIDTH, h),
        TileFormat::Bf16,
        &[(0, 64, 2)],
        true,
    );
    let e3_down = p.matrix(down(3), (h, WIDTH), TileFormat::Bf16, &[(0, 64, 3)], true);
    let lm = p.matrix(
        MatrixRole::LmHead,
        (VOCAB_ROWS, h),
        TileFormat::Bf16,
        &[(0, 16, 4)],
        true,
    );

    let io = |p: &mut Parts, bytes: usize| p.region(RegionKind::Io, MemoryKind::Sram, bytes as u64);
    let x = io(&mut p, n * h * 4);
    let slots = io(&mut p, n * TOP_K * 8);
    let out = io(&mut p, n * h * 4);
    let mut ops = vec![Op::Receive {
        x,
        slots: Some(slots),
    }];
    let mut experts = Vec::new();
    for (local, expert, (gu, dn), streamed) in [
        (0u32, 1u32, (e1_gate_up, e1_down), false),
        (1, 3, (e3_gate_up, e3_down), true),
    ] {
        let rows = RowCount::Expert(local);
        let (gathered, map) = (p.act(n * h * 4), p.act(n * 8));
        ops.push(Op::Gather {
            local,
            expert,
            slots,
            x,
            rows: gathered,
            map,
        });
        let (gu_out, act, y) = (
            p.act(n * 2 * WIDTH * 4),
            p.act(n * WIDTH * 4),
            p.act(n * h * 4),
        );
        for (m, input, output) in [(gu, gathered, gu_out), (dn, act, y)] {
            let staging = streamed.then(|| {
                let bytes = p.matrices[m as usize].bytes();
                p.region(RegionKind::Staging, MemoryKind::Sram, bytes)
            });
            if let Some(staging) = staging {
                ops.push(Op::Stream {
                    matrix: m,
                    tiles: vec![0],
                    staging,
                    offsets: vec![0],
                });
            }
            let partials = p.region(
                RegionKind::Partial,
                MemoryKind::Sram,
                (n * p.matrices[m as usize].rows * 4) as u64,
            );
            let tiles = runs(&p, m, staging);
            push_matmul(
                &mut ops,
                m,
                rows,
                (input, partials, output),
                tiles,
                OutLayout::TokenMajor,
            );
            if m == gu {
                ops.push(Op::Activate {
                    rows,
                    gate_up: gu_out,
                    out: act,
                    width: WIDTH as u32,
                    activation: ActivationSpec::SwiGlu,
                });
            }
        }
        ops.push(Op::Scale {
            rows,
            values: y,
            map,
        });
        experts.push((expert, map, y));
    }
    ops.push(Op::SumSlots {
        slots,
        experts,
        out,
    });
    ops.push(Op::Send { src: out });
    let layer0 = Span::new(0, ops.len());

    let dense_x = io(&mut p, n * h * 4);
    let dense_out = io(&mut p, n * h * 4);
    ops.push(Op::Receive {
        x: dense_x,
        slots: None,
    });
    ops.push(Op::Fill { region: dense_out });
    ops.push(Op::Send { src: dense_out });
    let layer1 = Span::new(layer0.end, ops.len());

    let lm_x = io(&mut p, n * h * 4);
    let staging = p.region(
        RegionKind::Staging,
        MemoryKind::Sram,
        p.matrices[lm as usize].bytes(),
    );
    let partials = p.region(
        RegionKind::Partial,
        MemoryKind::Sram,
        (n * VOCAB_ROWS * 4) as u64,
    );
    let logits = p.region(
        RegionKind::Logits,
        MemoryKind::Sram,
        (n * VOCAB_ROWS * 4) as u64,
    );
    // 4 candidates per token plus the fixed part: 64 bytes a token.
    let proposals = io(&mut p, n * 64);
    ops.push(Op::Receive {
        x: lm_x,
        slots: None,
    });
    ops.push(Op::Stream {
        matrix: lm,
        tiles: vec![0],
        staging,
        offsets: vec![0],
    });
    let tiles = runs(&p, lm, Some(staging));
    push_matmul(
        &mut ops,
        lm,
        RowCount::Tokens,
        (lm_x, partials, logits),
        tiles,
        OutLayout::RowMajor,
    );
    ops.push(Op::Propose {
        logits,
        out: proposals,
    });
    ops.push(Op::Send { src: proposals });
    let lm_span = Span::new(layer1.end, ops.len());
    assert_eq!(ops.len(), 28, "the indices in the doc above");

    Program {
        assignment: CardAssignment {
            card: 0,
            cards: 1,
            layers: vec![
                LayerShare::Moe {
                    experts: vec![1, 3],
                },
                LayerShare::Dense {
                    columns: Span::new(0, 0),
                },
            ],
            lm_head_rows: Span::new(0, VOCAB_ROWS),
        },
        profile: HardwareProfile::default(),
        hidden: h,
        top_k: TOP_K,
        num_experts: EXPERTS,
        max_tokens: n,
        expert_activation: ActivationSpec::SwiGlu,
        regions: p.regions,
        matrices: p.matrices,
        instructions: ops,
        layers: vec![
            LayerProgram {
                kind: LayerKind::Moe {
                    experts: vec![1, 3],
                    matrices: vec![(e1_gate_up, e1_down), (e3_gate_up, e3_down)],
                },
                instructions: layer0,
                input: x,
                slots: Some(slots),
                output: out,
            },
            LayerProgram {
                kind: LayerKind::Dense {
                    columns: Span::new(0, 0),
                    matrices: None,
                },
                instructions: layer1,
                input: dense_x,
                slots: None,
                output: dense_out,
            },
        ],
        lm_head: Some(LmHeadProgram {
            rows: Span::new(0, VOCAB_ROWS),
            matrix: lm,
            instructions: lm_span,
            input: lm_x,
            logits,
        }),
        pool_base: 0,
        pool_bytes: 0,
    }
}

#[track_caller]
fn assert_close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-9 * want.abs(),
        "{what}: modeled {got:e} s, worked out {want:e} s"
    );
}

/// The profile's figures the hand calculations use, in seconds per unit.
struct Figures {
    instruction: f64,
    tile: f64,
    dma: f64,
    link: f64,
    host: f64,
    sram: f64,
    core_sram: f64,
    lpddr: f64,
    noc: f64,
    vector: f64,
    core_bf16: f64,
    core_mxfp4: f64,
}

fn figures(p: &HardwareProfile) -> Figures {
    let h = &p.hierarchy;
    let cores = (h.packages
        * h.chiplets_per_package
        * h.gangs_per_chiplet
        * h.slices_per_gang
        * h.cores_per_slice) as f64;
    Figures {
        instruction: p.latency.instruction_ns * 1e-9,
        tile: p.latency.tile_issue_ns * 1e-9,
        dma: p.latency.dma_setup_ns * 1e-9,
        link: p.latency.host_link_ns * 1e-9,
        host: p.memory.host_link_bandwidth,
        sram: p.memory.sram_bandwidth,
        core_sram: p.memory.sram_bandwidth / cores,
        lpddr: p.memory.lpddr_bandwidth,
        noc: p.memory.noc_bandwidth,
        vector: p.compute.vector_elements_per_second,
        core_bf16: p.compute.bf16_flops / cores,
        core_mxfp4: p.compute.mxfp4_flops / cores,
    }
}

/// Bytes of the tiles (bf16: 2 bytes a weight; MXFP4: 16 bytes and one scale byte per block
/// of 32 weights).
const GATE_UP_BAND_16: f64 = 16.0 * 64.0 * 2.0;
const GATE_UP_BAND_32: f64 = 32.0 * 64.0 * 2.0;
const E1_DOWN: f64 = 64.0 * 17.0;
const BF16_GATE_UP: f64 = 64.0 * 64.0 * 2.0;
const BF16_DOWN: f64 = 64.0 * 32.0 * 2.0;
const LM_TILE: f64 = 16.0 * 64.0 * 2.0;

/// One tile on its core: the slower of reading its bytes and its arithmetic, plus its issue.
fn tile(f: &Figures, bytes: f64, rows: f64, cols: f64, r: f64, core_flops: f64) -> f64 {
    (bytes / f.core_sram).max(2.0 * rows * cols * r / core_flops) + f.tile
}

/// Every instruction's expected seconds for `tokens` tokens with `r1` rows routed to expert
/// 1 and `r3` to expert 3.
fn expected(f: &Figures, tokens: usize, r1: usize, r3: usize) -> Vec<f64> {
    let (n, h, k, w) = (tokens as f64, 64.0, 2.0, 32.0);
    let (r1, r3) = (r1 as f64, r3 as f64);
    let busy = |r: f64, t: f64| if r == 0.0 { 0.0 } else { t };
    let link_in = f.link + (n * h * 4.0) / f.host;
    let mut e = vec![
        // Receive: the rows and the (expert, weight) slots.
        f.link + (n * h * 4.0 + n * k * 8.0) / f.host,
        // Gather: read and write the routed rows in SRAM.
        busy(r1, f.instruction + 2.0 * r1 * h * 4.0 / f.sram),
        // gate_up e1: core 0 runs two tiles one after the other, core 1 one; the slower core,
        // then the input broadcast over the fabric.
        busy(
            r1,
            f.instruction
                + (tile(f, GATE_UP_BAND_16, 16.0, h, r1, f.core_bf16)
                    + tile(f, GATE_UP_BAND_32, 32.0, h, r1, f.core_bf16))
                .max(tile(f, GATE_UP_BAND_16, 16.0, h, r1, f.core_bf16))
                + r1 * h * 4.0 / f.noc,
        ),
        // Reduce: one partial (a single segment) per output row over the fabric.
        busy(r1, f.instruction + r1 * 64.0 * 4.0 / f.noc),
        busy(r1, f.instruction + r1 * w / f.vector),
        busy(
            r1,
            f.instruction + tile(f, E1_DOWN, 64.0, w, r1, f.core_mxfp4) + r1 * w * 4.0 / f.noc,
        ),
        busy(r1, f.instruction + r1 * 64.0 * 4.0 / f.noc),
        busy(r1, f.instruction + r1 * h / f.vector),
        busy(r3, f.instruction + 2.0 * r3 * h * 4.0 / f.sram),
        // Stream: the spilled tiles from LPDDR (nothing when the expert gets no rows).
        busy(r3, f.dma + BF16_GATE_UP / f.lpddr),
        busy(
            r3,
            f.instruction + tile(f, BF16_GATE_UP, 64.0, h, r3, f.core_bf16) + r3 * h * 4.0 / f.noc,
        ),
        busy(r3, f.instruction + r3 * 64.0 * 4.0 / f.noc),
        busy(r3, f.instruction + r3 * w / f.vector),
        busy(r3, f.dma + BF16_DOWN / f.lpddr),
        busy(
            r3,
            f.instruction + tile(f, BF16_DOWN, 64.0, w, r3, f.core_bf16) + r3 * w * 4.0 / f.noc,
        ),
        busy(r3, f.instruction + r3 * 64.0 * 4.0 / f.noc),
        busy(r3, f.instruction + r3 * h / f.vector),
        // Sum over every token's slots.
        f.instruction + n * k * h / f.vector,
        // Send: the partial sums of the call's tokens.
        f.link + n * h * 4.0 / f.host,
    ];
    // The empty dense slice: receive, zeros, send.
    e.extend([link_in, f.instruction + n * h / f.vector, link_in]);
    // The LM head: receive, stream its rows, matmul and reduce for every token, propose over
    // the shard's 16 rows, send 64 bytes a token.
    e.extend([
        link_in,
        f.dma + LM_TILE / f.lpddr,
        f.instruction + tile(f, LM_TILE, 16.0, h, n, f.core_bf16) + n * h * 4.0 / f.noc,
        f.instruction + n * 16.0 * 4.0 / f.noc,
        f.instruction + 4.0 * n * 16.0 / f.vector,
        f.link + n * 64.0 / f.host,
    ]);
    e
}

/// Rows of expert 1 and 3 in each case: one row (SRAM-read bound tiles), eight rows (the
/// arithmetic bound), an idle spilled expert, an idle resident one.
const LOADS: [(usize, usize, usize); 4] = [(3, 1, 2), (8, 8, 8), (5, 5, 0), (2, 0, 2)];

#[test]
fn every_instruction_takes_the_time_worked_out_by_hand() {
    let p = program();
    let f = figures(&p.profile);
    for (tokens, r1, r3) in LOADS {
        let load = LayerLoad {
            tokens,
            expert_rows: vec![r1, r3],
        };
        let want = expected(&f, tokens, r1, r3);
        for (i, want) in want.iter().enumerate() {
            let got = instruction_seconds(&p, i, &load);
            assert_close(
                got,
                *want,
                &format!("instruction {i} at {tokens} tokens, rows ({r1}, {r3})"),
            );
        }
    }
}

#[test]
fn one_row_is_bound_by_sram_reads_and_eight_by_arithmetic() {
    // The premise of the two loads above, from the figures alone: a bf16 tile of 16 rows x 64
    // columns reads 2 KiB at a core's share of the SRAM bandwidth; its arithmetic is
    // 2 x 16 x 64 FLOP per row at a core's bf16 rate.
    let f = figures(&HardwareProfile::default());
    let read = GATE_UP_BAND_16 / f.core_sram;
    let flops = |r: f64| 2.0 * 16.0 * 64.0 * r / f.core_bf16;
    assert!(read > flops(1.0), "{read:e} vs {:e}", flops(1.0));
    assert!(read < flops(8.0), "{read:e} vs {:e}", flops(8.0));
}

#[test]
fn layer_times_add_up_by_kind() {
    let p = program();
    let f = figures(&p.profile);
    let (tokens, r1, r3) = (3, 1, 2);
    let e = expected(&f, tokens, r1, r3);
    let t = layer_time(
        &p,
        0,
        &LayerLoad {
            tokens,
            expert_rows: vec![r1, r3],
        },
    );
    assert_close(t.seconds, e[..19].iter().sum(), "layer 0");
    assert_close(t.lpddr_seconds, e[9] + e[13], "layer 0 streams");
    assert_close(
        t.matmul_seconds,
        e[2] + e[5] + e[10] + e[14],
        "layer 0 matmuls",
    );
    assert_close(t.io_seconds, e[0] + e[18], "layer 0 host link");
    let lm = lm_head_time(&p, tokens);
    assert_close(lm.seconds, e[22..].iter().sum(), "LM head");
    assert_close(lm.lpddr_seconds, e[23], "LM-head stream");
    assert_close(lm.io_seconds, e[22] + e[27], "LM-head host link");
}

#[test]
fn a_step_routes_uniformly_and_sums_every_layer() {
    let p = program();
    let f = figures(&p.profile);
    // 3 tokens x 2 slots over 4 experts: ceil(6 / 4) = 2 rows for each local expert.
    assert_eq!(LayerLoad::uniform(&p, 0, 3).expert_rows, vec![2, 2]);
    // 1 token: ceil(2 / 4) = 1 (at batch 1 every expert counts as busy), never above the tokens.
    assert_eq!(LayerLoad::uniform(&p, 0, 1).expert_rows, vec![1, 1]);
    assert_eq!(LayerLoad::uniform(&p, 0, 8).expert_rows, vec![4, 4]);
    assert!(LayerLoad::uniform(&p, 1, 3).expert_rows.is_empty());
    let e = expected(&f, 3, 2, 2);
    let s = step_time(&p, 3);
    assert_eq!(s.tokens, 3);
    assert_eq!(s.layers.len(), 2);
    assert_close(s.layers[1].seconds, e[19..22].iter().sum(), "dense slice");
    assert_close(s.seconds, e.iter().sum(), "step");
    assert_close(s.lpddr_seconds, e[9] + e[13] + e[23], "step streams");
}

/// The table by count gives every load the time `layer_time` gives it, including counts of
/// zero (an idle expert's stream is skipped) and loads seen twice.
#[test]
fn the_table_by_count_times_layers_as_layer_time_does() {
    let p = program();
    for layer in 0..p.layers.len() {
        let mut table = LayerCosts::new(&p, layer);
        for tokens in 0..=MAX_TOKENS {
            for r1 in 0..=tokens.min(3) {
                for r3 in [0, tokens / 2, tokens] {
                    let load = LayerLoad {
                        tokens,
                        expert_rows: vec![r1, r3],
                    };
                    let want = layer_time(&p, layer, &load);
                    for _ in 0..2 {
                        let got = table.time(&p, &load);
                        assert_close(got.seconds, want.seconds, "seconds");
                        assert_close(got.lpddr_seconds, want.lpddr_seconds, "lpddr");
                        assert_close(got.matmul_seconds, want.matmul_seconds, "matmul");
                        assert_close(got.io_seconds, want.io_seconds, "io");
                    }
                }
            }
        }
    }
}

#[test]
fn a_weight_pass_is_worth_the_rows_whose_arithmetic_takes_as_long() {
    let p = program();
    let per_layer = rows_per_weight_read(&p);
    assert_eq!(per_layer.len(), p.layers.len());
    for (layer, &got) in per_layer.iter().enumerate() {
        let moe = matches!(p.layers[layer].kind, LayerKind::Moe { .. });
        if !moe {
            assert_eq!(got, u32::MAX, "layer {layer} has no experts");
            continue;
        }
        // Expert 0's own time at `r` rows, from whole-layer times.
        let own = |r: usize| {
            let at = |rows: usize| {
                layer_time(
                    &p,
                    layer,
                    &LayerLoad {
                        tokens: 0,
                        expert_rows: vec![rows, 0],
                    },
                )
                .seconds
            };
            at(r) - at(0)
        };
        let half = MAX_TOKENS / 2;
        let slope = (own(MAX_TOKENS) - own(half)) / (MAX_TOKENS - half) as f64;
        assert!(slope > 0.0, "the arithmetic grows with the rows");
        assert_eq!(got, (own(1) / slope).round() as u32, "layer {layer}");
        // One row waits on the weights (more than one row's worth of arithmetic).
        assert!(got > 1, "layer {layer}: {got}");
    }
}

#[test]
fn a_copys_fixed_rows_are_where_its_compute_bound_line_meets_no_rows() {
    let p = program();
    let fixed = fixed_rows_per_copy(&p);
    let whole = rows_per_weight_read(&p);
    assert_eq!(fixed.len(), p.layers.len());
    for (layer, (&f, &c)) in fixed.iter().zip(&whole).enumerate() {
        if !matches!(p.layers[layer].kind, LayerKind::Moe { .. }) {
            assert_eq!(f, 0, "layer {layer} has no experts");
            continue;
        }
        // Expert 0's own time at `r` rows, from whole-layer times.
        let own = |r: usize| {
            let load = |rows: usize| LayerLoad {
                tokens: 0,
                expert_rows: vec![rows, 0],
            };
            layer_time(&p, layer, &load(r)).seconds - layer_time(&p, layer, &load(0)).seconds
        };
        let half = MAX_TOKENS / 2;
        let slope = (own(MAX_TOKENS) - own(half)) / (MAX_TOKENS - half) as f64;
        let intercept = own(MAX_TOKENS) - slope * MAX_TOKENS as f64;
        assert_eq!(f, (intercept / slope).round() as u32, "layer {layer}");
        // The instructions' fixed latencies are some of a row's cost, never all of it.
        assert!(f > 0 && f < c, "layer {layer}: {f} of {c}");
    }
}
