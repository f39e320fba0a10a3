//! GPT-OSS-20B's shape, compiled from the config alone: 8 cards fit in MXFP4 with the experts
//! SRAM-resident; 4 cards do not, with a clear message; 4 cards with spilling compile and pay
//! for LPDDR streams in the modeled time.

use corsair_ffn::Error;
use corsair_ffn::assignment::{PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile};
use corsair_ffn::format::TileFormat;
use corsair_ffn::perf::step_time;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::program::{MemoryKind, RegionKind};
use corsair_ffn::report::summarize;
use corsair_ffn::synthetic::gpt_oss_config;

fn stored() -> StoredFormats {
    StoredFormats {
        experts: TileFormat::Mxfp4,
        ..StoredFormats::uniform(TileFormat::Bf16)
    }
}

#[test]
fn eight_cards_fit_with_every_expert_in_sram() {
    let cfg = gpt_oss_config(24, 32, 4, 2880, 2880, 201_088);
    let profile = HardwareProfile::default();
    let plan = plan_placement(
        &cfg,
        &PlacementOptions {
            cards: 8,
            replicas: vec![],
        },
    )
    .unwrap();
    for a in &plan {
        let c = compile(&cfg, &stored(), a, &CompileOptions::default(), &profile).unwrap();
        let s = summarize(&c);
        assert!(s.spilled.is_empty());
        assert!(s.sram_used < s.sram_capacity);
        // 4 experts x 24 layers x 13.2 MB of MXFP4 (4.25 bits per weight).
        let experts = c
            .program
            .resident_bytes(RegionKind::ExpertWeight, MemoryKind::Sram);
        assert_eq!(experts, 4 * 24 * (5760 + 2880) * 1530);
        assert!(
            c.program
                .resident_bytes(RegionKind::ExpertWeight, MemoryKind::Lpddr)
                == 0
        );
        assert!(s.batch_one.seconds > 0.0 && s.batch_max.seconds > s.batch_one.seconds);
        assert!(s.to_string().contains("SRAM"));
    }
}

#[test]
fn four_cards_do_not_fit_and_say_what_to_do() {
    let cfg = gpt_oss_config(24, 32, 4, 2880, 2880, 201_088);
    let plan = plan_placement(
        &cfg,
        &PlacementOptions {
            cards: 4,
            replicas: vec![],
        },
    )
    .unwrap();
    let err = compile(
        &cfg,
        &stored(),
        &plan[0],
        &CompileOptions::default(),
        &HardwareProfile::default(),
    )
    .unwrap_err();
    let Error::DoesNotFit(fit) = &err else {
        panic!("expected DoesNotFit, got {err}")
    };
    assert!(fit.needed_bytes > fit.sram_bytes);
    let msg = err.to_string();
    for needle in [
        "needs",
        "GB",
        "expert weights",
        "more cards",
        "--allow-spill",
    ] {
        assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
    }
}

#[test]
fn four_cards_with_spill_compile_and_pay_for_lpddr() {
    let cfg = gpt_oss_config(24, 32, 4, 2880, 2880, 201_088);
    let profile = HardwareProfile::default();
    let plan = plan_placement(
        &cfg,
        &PlacementOptions {
            cards: 4,
            replicas: vec![],
        },
    )
    .unwrap();
    let options = CompileOptions {
        allow_spill: true,
        ..CompileOptions::default()
    };
    let c = compile(&cfg, &stored(), &plan[0], &options, &profile).unwrap();
    let s = summarize(&c);
    assert!(!s.spilled.is_empty());
    assert!(s.sram_used <= s.sram_capacity);
    let spilled = c
        .program
        .resident_bytes(RegionKind::ExpertWeight, MemoryKind::Lpddr);
    assert_eq!(spilled, s.spilled_bytes);
    // Every MoE layer streams some weights; the modeled LPDDR time covers those bytes.
    let t = step_time(&c.program, 1);
    assert!(t.layers.iter().all(|l| l.lpddr_seconds > 0.0));
    let layer_lpddr: f64 = t.layers.iter().map(|l| l.lpddr_seconds).sum();
    assert!(layer_lpddr >= spilled as f64 / profile.memory.lpddr_bandwidth);
}
