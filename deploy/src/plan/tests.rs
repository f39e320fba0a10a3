use std::path::Path;

use super::*;

fn deployment(text: &str) -> Deployment {
    Deployment::from_toml(text, Path::new(".")).unwrap()
}

fn plan_text(text: &str) -> planner::Plan {
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
fn experts_are_replicated_by_default_where_the_copies_fit_in_sram() {
    // The tiny shape on 2 cards: both hold every expert, so either card may go.
    let tiny = plan_text(&format!("{TINY}[cards]\ncount = 2\n"));
    assert!(tiny.experts_replicated, "{:?}", tiny.replication);
    assert!(tiny.card_losses.iter().all(|l| l.survived));
    assert!(tiny.to_string().contains("a copy of every expert"));
    // GPT-OSS-20B: 8 cards hold one copy (about 1.5 GB of experts each in 2 GiB of SRAM), not
    // two; 16 hold two, without spilling.
    let twenty = |cards: usize| {
        plan_text(&format!(
            "[model]\nshape = \"gpt-oss-20b\"\n[cards]\ncount = {cards}\n"
        ))
    };
    let eight = twenty(8);
    assert!(eight.fits, "{:?}", eight.problems);
    assert!(!eight.experts_replicated);
    assert!(
        eight.replication.as_deref().unwrap().contains("SRAM"),
        "{:?}",
        eight.replication
    );
    let sixteen = twenty(16);
    assert!(sixteen.fits, "{:?}", sixteen.problems);
    assert!(sixteen.experts_replicated, "{:?}", sixteen.replication);
    assert!(sixteen.per_card.iter().all(|c| c.spilled_bytes == 0));
    // Asked for, the copies that do not fit fail the plan instead.
    let forced = plan_text(
        "[model]\nshape = \"gpt-oss-20b\"\n[cards]\ncount = 8\nreplicate_experts = true\n",
    );
    assert!(!forced.fits);
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
fn the_plan_says_which_card_losses_a_placement_survives() {
    let plain = plan_text(&format!(
        "{TINY}[cards]\ncount = 2\nreplicate_experts = false\n"
    ));
    assert_eq!(plain.card_losses.len(), 2);
    assert!(plain.card_losses.iter().all(|l| !l.survived));
    assert!(
        plain.card_losses[1]
            .reason
            .as_deref()
            .unwrap()
            .contains("held only by card(s) [1]")
    );
    assert!(
        plain
            .to_string()
            .contains("survives the loss of card(s): none")
    );
    let (text, path) = deployment(TINY).model_config_text().unwrap();
    let experts = ModelConfig::from_json(&text, &path)
        .unwrap()
        .moe
        .unwrap()
        .num_experts;
    let all: Vec<String> = (0..experts)
        .map(|e| format!("{{ expert = {e} }}"))
        .collect();
    let replicated = plan_text(&format!(
        "{TINY}[cards]\ncount = 2\nreplicate_experts = false\nreplicas = [{}]\n",
        all.join(", ")
    ));
    assert!(replicated.card_losses.iter().all(|l| l.survived));
    assert!(
        replicated
            .to_string()
            .contains("survives the loss of any one card")
    );
    // Half of them: card 0's experts are copied onto card 1, not card 1's onto card 0.
    let half: Vec<String> = (0..experts / 2)
        .map(|e| format!("{{ expert = {e} }}"))
        .collect();
    let half = plan_text(&format!(
        "{TINY}[cards]\ncount = 2\nreplicate_experts = false\nreplicas = [{}]\n",
        half.join(", ")
    ));
    let survived: Vec<bool> = half.card_losses.iter().map(|l| l.survived).collect();
    assert_eq!(survived, vec![true, false]);
}
