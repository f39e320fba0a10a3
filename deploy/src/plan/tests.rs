use std::path::Path;

use super::*;

fn deployment(text: &str) -> Deployment {
    Deployment::from_toml(text, Path::new(".")).unwrap()
}

fn plan_text(text: &str) -> Plan {
    let d = deployment(text);
    let (model_text, path) = d.model_config_text().unwrap();
    let config = ModelConfig::from_json(&model_text, &path).unwrap();
    let stored = StoredFormats::from_config_json(&model_text, &config).unwrap();
    plan(&d, &config, &stored, &load_profiles(&d).unwrap()).unwrap()
}

const TINY: &str = "[model]\nshape = \"tiny\"\n";

#[test]
fn a_small_shape_fits_and_is_predicted() {
    let p = plan_text(&format!("{TINY}[cards]\ncount = 2\n"));
    assert!(p.fits, "{:?}", p.problems);
    assert_eq!(p.per_card.len(), 2);
    for c in &p.per_card {
        assert!(c.sram_bytes_needed > 0 && c.sram_bytes_needed <= c.sram_bytes_available);
    }
    let predicted = p.predicted.unwrap();
    assert!(predicted.tpot_ms > 0.0 && predicted.tpot_ms.is_finite());
    assert!(predicted.output_tokens_per_s > 0.0);
}

#[test]
fn more_cards_need_less_sram_each() {
    let need = |cards: usize| {
        let p = plan_text(&format!("{TINY}[cards]\ncount = {cards}\n"));
        p.per_card
            .iter()
            .map(|c| c.sram_bytes_needed)
            .max()
            .unwrap()
    };
    assert!(need(4) < need(1));
}

#[test]
fn longer_contexts_cost_more_per_token() {
    let tpot = |ctx: usize| {
        let p = plan_text(&format!(
            "{TINY}[cards]\ncount = 0\n[attention]\nmax_model_len = 70000\n\
             [workload]\ninput_len = {ctx}\noutput_len = 0\n"
        ));
        p.predicted.unwrap().tpot_ms
    };
    assert!(tpot(65536) > tpot(1024));
}

#[test]
fn larger_batches_raise_throughput() {
    let rate = |batch: usize| {
        let p = plan_text(&format!(
            "{TINY}[cards]\ncount = 2\n[workload]\nbatch = {batch}\noutput_len = 0\n"
        ));
        p.predicted.unwrap().output_tokens_per_s
    };
    assert!(rate(16) > rate(1));
}

#[test]
fn an_attention_device_too_small_is_reported() {
    let p = plan_text(
        "[model]\nshape = \"gpt-oss-20b\"\n[cards]\ncount = 8\n\
         [attention]\nmax_num_seqs = 64\nmax_model_len = 131072\n",
    );
    assert!(!p.fits);
    assert!(
        p.problems.iter().any(|m| m.contains("max_num_seqs")),
        "{:?}",
        p.problems
    );
}

#[test]
fn cards_per_token_and_distinct_experts() {
    // One expert per token on a single card: every token goes to it.
    assert!((gpu::distinct_experts(32, 4, 1) - 4.0).abs() < 1e-9);
    assert!(gpu::distinct_experts(32, 4, 64) > 31.0);
    assert!(gpu::distinct_experts(32, 4, 64) <= 32.0);
}
