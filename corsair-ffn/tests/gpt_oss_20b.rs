//! GPT-OSS-20B's shape (from the config alone): fits 8 cards in MXFP4, not 4 unless spilling.

use corsair_ffn::assignment::{PlacementOptions, plan_placement};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile};
use corsair_ffn::format::TileFormat;
use corsair_ffn::profile::HardwareProfile;
use corsair_ffn::synthetic::gpt_oss_config;

fn stored() -> StoredFormats {
    StoredFormats {
        experts: TileFormat::Mxfp4,
        ..StoredFormats::uniform(TileFormat::Bf16)
    }
}

#[test]
fn eight_cards_fit() {
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
    let t = std::time::Instant::now();
    let c = compile(
        &cfg,
        &stored(),
        &plan[0],
        &CompileOptions::default(),
        &profile,
    )
    .unwrap();
    eprintln!("compile {:?}", t.elapsed());
    let s = corsair_ffn::report::summarize(&c);
    eprintln!("{s}");
}
