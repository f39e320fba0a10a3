//! Serving with the experts placed by measured load (`cards.placement = "load"`): the cards load
//! the shares the planner's EPLB placement gives them, the node splits a hot replicated
//! expert's rows over its copies, and the tokens stay those of transformers.

use std::path::Path;

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use deploy::load_placement::LoadPlacement;
use emulate::record::{FORMAT, RoutingCounts, RoutingWindow};
use gpu_attention::driver;
use model::generate::GenerationRequest;
use model::sampling::SamplingParams;

mod common;

use common::{expected, fixtures, greedy_requests};

/// A record of `dir`'s model in which, in every layer, experts 0 and 1 take most tokens.
fn skewed_record(dir: &Path, out: &Path) {
    let config = model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let moe = config.moe.unwrap();
    let counts = config
        .moe_layers()
        .iter()
        .map(|&is_moe| {
            if !is_moe {
                return Vec::new();
            }
            (0..moe.num_experts)
                .map(|e| match e {
                    0 => 1000,
                    1 => 600,
                    _ => 20,
                })
                .collect()
        })
        .collect();
    RoutingCounts {
        format: FORMAT.into(),
        layers: config.num_layers(),
        experts: moe.num_experts,
        top_k: moe.top_k,
        window_steps: 100,
        windows: vec![RoutingWindow {
            first_step: 0,
            steps: 100,
            tokens: 800,
            counts,
        }],
    }
    .write(out)
    .unwrap();
}

#[test]
fn a_placement_by_load_copies_the_hot_experts_splits_their_rows_and_keeps_the_tokens() {
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("gpt-oss-mxfp4"))
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let record = tmp.path().join("routing.json");
    skewed_record(&dir, &record);
    let mut config = ClusterConfig::new(&dir, 2);
    config.transport = TransportKind::Inproc;
    config.node.kv.memory_bytes = 8 << 20;
    config.expert_load = Some(LoadPlacement {
        record: record.clone(),
        num_redundant_experts: 2,
        card_groups: 1,
    });
    let mut cluster = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
    // Two extra copies a layer go to the two hottest experts: both cards hold 0 and 1; the
    // cold ones are packed one a card.
    for a in &cluster.assignments {
        for (layer, share) in a.layers.iter().enumerate() {
            if let corsair_ffn::assignment::LayerShare::Moe { experts } = share {
                assert!(
                    experts.contains(&0) && experts.contains(&1),
                    "card {} layer {layer}: {experts:?}",
                    a.card
                );
                assert_eq!(experts.len(), 3, "card {} layer {layer}", a.card);
            }
        }
    }
    let mut node = cluster.take_nodes().remove(0);
    let per_layer = node.rows_per_weight_read();
    assert!(
        per_layer.iter().all(|r| (1..u32::MAX).contains(r)),
        "every MoE layer's figure came from the cards: {per_layer:?}"
    );
    let fixed = node.fixed_rows_per_copy();
    assert!(
        fixed.iter().zip(&per_layer).all(|(f, r)| *f > 0 && f < r),
        "every MoE layer's fixed part came from the cards, below its whole: {fixed:?} of {per_layer:?}"
    );
    // Greedy tokens as transformers gives them.
    let cases = expected(&dir);
    let got = driver::generate(&mut node, &greedy_requests(&cases), 0).unwrap();
    for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
        assert_eq!(&g.output_ids, want, "prompt {i}");
    }
    // A long prompt's prefill routes many rows to each hot expert: more than one pass over
    // its weights is worth, so they are split over the two copies.
    let hot = *per_layer.iter().max().unwrap_or(&1) as usize;
    let prompt: Vec<u32> = (0..(8 * hot).clamp(64, 512) as u32)
        .map(|j| (j * 37) % 250)
        .collect();
    let before = node.stats().split_experts;
    driver::generate(
        &mut node,
        &[GenerationRequest {
            prompt,
            max_tokens: 2,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
        }],
        0,
    )
    .unwrap();
    assert!(
        node.stats().split_experts > before,
        "no expert's rows were split (rows per weight pass {per_layer:?})"
    );
}
