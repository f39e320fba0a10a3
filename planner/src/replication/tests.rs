use corsair_ffn::HardwareProfile;
use corsair_ffn::compiler::{CompileOptions, StoredFormats};
use model::ModelConfig;

use super::*;

#[test]
fn the_setting_reads_as_a_word_or_a_bool() {
    #[derive(serde::Deserialize)]
    struct Cards {
        replicate_experts: ReplicateExperts,
    }
    for (text, want) in [
        ("replicate_experts = \"auto\"", ReplicateExperts::Auto),
        ("replicate_experts = true", ReplicateExperts::Always),
        ("replicate_experts = false", ReplicateExperts::Never),
        ("replicate_experts = \"false\"", ReplicateExperts::Never),
    ] {
        let c: Cards = toml::from_str(text).unwrap();
        assert_eq!(c.replicate_experts, want, "{text}");
        // What the CLI takes and what a written deployment file says read back the same.
        assert_eq!(want.to_string().parse::<ReplicateExperts>(), Ok(want));
    }
    let e = toml::from_str::<Cards>("replicate_experts = \"sometimes\"")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("sometimes") && e.contains("auto, true or false"),
        "{e}"
    );
}

/// The tiny shape, its stored formats and the default card.
fn tiny() -> (ModelConfig, StoredFormats) {
    crate::tests::shape("tiny")
}

fn decide(setting: ReplicateExperts, cards: usize, host: Option<u64>) -> ReplicationChoice {
    let (model, stored) = tiny();
    choose(
        setting,
        &CardsToFit {
            model: &model,
            stored: &stored,
            options: &CompileOptions::default(),
            profile: &HardwareProfile::default(),
            cards,
            listed: &[],
            host_available: host,
        },
    )
}

#[test]
fn auto_replicates_a_small_model_on_two_cards_and_says_why() {
    let c = decide(ReplicateExperts::Auto, 2, None);
    assert!(c.every_expert, "{}", c.reason);
    assert!(c.reason.contains("fits"), "{}", c.reason);
    assert!(decide(ReplicateExperts::Auto, 2, Some(64 << 30)).every_expert);
}

#[test]
fn auto_keeps_one_copy_on_one_card_or_without_host_memory() {
    let one = decide(ReplicateExperts::Auto, 1, None);
    assert!(
        !one.every_expert && one.reason.contains("one card"),
        "{}",
        one.reason
    );
    // The same cards on a host with 4 KB free: the copies would take more than half of it.
    let host = decide(ReplicateExperts::Auto, 2, Some(4096));
    assert!(!host.every_expert, "{}", host.reason);
    assert!(host.reason.contains("available memory"), "{}", host.reason);
}

#[test]
fn true_and_false_are_taken_as_given() {
    assert!(decide(ReplicateExperts::Always, 1, Some(0)).every_expert);
    assert!(!decide(ReplicateExperts::Never, 2, None).every_expert);
}

/// The half-of-memory rule at its edge: the copies' bytes exactly half of what the host has
/// left replicate, a byte more than half does not.
#[test]
fn auto_replicates_up_to_exactly_half_of_the_hosts_memory() {
    use corsair_ffn::assignment::{ExpertReplica, PlacementOptions};
    use corsair_ffn::compiler::compile_deployment;
    let (model, stored) = tiny();
    let options = CompileOptions {
        allow_spill: false,
        ..CompileOptions::default()
    };
    let placement = PlacementOptions {
        cards: 2,
        replicas: ExpertReplica::placed(Vec::new(), true, &model),
    };
    let bytes: u64 = compile_deployment(
        &model,
        &stored,
        &placement,
        &options,
        &HardwareProfile::default(),
    )
    .unwrap()
    .into_iter()
    .map(|c| corsair_ffn::report::sram_needed(&c.unwrap().program))
    .sum();
    assert!(bytes > 1 << 16, "{bytes} bytes");
    assert!(decide(ReplicateExperts::Auto, 2, Some(2 * bytes)).every_expert);
    assert!(decide(ReplicateExperts::Auto, 2, Some(2 * bytes + 1)).every_expert);
    let short = decide(ReplicateExperts::Auto, 2, Some(2 * bytes - 2));
    assert!(!short.every_expert, "{}", short.reason);
}
