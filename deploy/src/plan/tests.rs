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
fn cards_per_token_and_distinct_experts() {
    // One expert per token on a single card: every token goes to it.
    assert!((gpu::distinct_experts(32, 4, 1) - 4.0).abs() < 1e-9);
    assert!(gpu::distinct_experts(32, 4, 64) > 31.0);
    assert!(gpu::distinct_experts(32, 4, 64) <= 32.0);
}

mod properties {
    use std::sync::OnceLock;

    use corsair_ffn::assignment::PlacementOptions;
    use corsair_ffn::compiler::{CompileOptions, compile_deployment};
    use gpu_attention::MicroBatches;
    use proptest::prelude::*;

    use super::*;

    const MAX_CARDS: usize = 4;

    /// The `small` GPT-OSS shape, its profiles and its cards compiled for 1..=4 cards.
    struct Fixture {
        config: ModelConfig,
        profiles: Profiles,
        sets: Vec<CardSet>,
    }

    fn fixture() -> &'static Fixture {
        static FIXTURE: OnceLock<Fixture> = OnceLock::new();
        FIXTURE.get_or_init(|| {
            let d = deployment("[model]\nshape = \"small\"\n");
            let (text, path) = d.model_config_text().unwrap();
            let config = ModelConfig::from_json(&text, &path).unwrap();
            let stored = StoredFormats::from_config_json(&text, &config).unwrap();
            let profiles = load_profiles(&d).unwrap();
            let options = CompileOptions {
                max_tokens: 256,
                ..CompileOptions::default()
            };
            let sets = (1..=MAX_CARDS)
                .map(|cards| {
                    let placement = PlacementOptions {
                        cards,
                        replicas: vec![],
                    };
                    let programs =
                        compile_deployment(&config, &stored, &placement, &options, &profiles.card)
                            .unwrap()
                            .into_iter()
                            .map(|c| c.unwrap().program)
                            .collect();
                    CardSet::new(programs)
                })
                .collect();
            Fixture {
                config,
                profiles,
                sets,
            }
        })
    }

    fn system(f: &Fixture, cards: usize, nodes: usize, two: bool) -> System<'_> {
        System {
            model: &f.config,
            device: &f.profiles.device,
            network: &f.profiles.network,
            cards: (cards > 0).then(|| &f.sets[cards - 1]),
            nodes,
            micro_batches: if two {
                MicroBatches::Two
            } else {
                MicroBatches::One
            },
            wire_bytes: 2,
            chunk_tokens: 256,
            lm_head_candidates: 64,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn steps_are_positive_and_never_faster_at_longer_contexts(
            cards in 0..=MAX_CARDS,
            nodes in 1usize..=2,
            batch in 1usize..=64,
            context in 1usize..8192,
            extra in 0usize..8192,
            two in any::<bool>(),
        ) {
            let f = fixture();
            let s = system(f, cards, nodes, two);
            let short = s.step(batch, 1, context as f64);
            let long = s.step(batch, 1, (context + extra) as f64);
            prop_assert!(short.seconds.is_finite() && short.seconds > 0.0);
            prop_assert!(long.seconds >= short.seconds * (1.0 - 1e-12));
            prop_assert!(short.layers_seconds > 0.0 && short.lm_head_seconds >= 0.0);
        }

        #[test]
        fn doubling_the_batch_at_most_doubles_the_step(
            cards in 0..=MAX_CARDS,
            batch in 1usize..=32,
            context in 1usize..4096,
        ) {
            let f = fixture();
            let s = system(f, cards, 1, false);
            let one = s.step(batch, 1, context as f64).seconds;
            let two = s.step(2 * batch, 1, context as f64).seconds;
            prop_assert!(two >= one * (1.0 - 1e-12), "{two} < {one}");
            prop_assert!(two <= 2.0 * one * (1.0 + 1e-12), "{two} > 2 x {one}");
        }
    }
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
