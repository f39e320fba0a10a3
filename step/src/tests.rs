//! The step API's small rules: which penalties and logprobs a request asks for, how the
//! micro-batch setting parses, the trait's defaults, and how health reads.

use super::*;
use crate::clock::{DilatedClock, VirtualClock};
use model::sampling::SamplingParams;

#[test]
fn penalties_are_active_when_any_one_differs_from_neutral() {
    let neutral = Penalties::default();
    assert!(!neutral.is_active());
    for p in [
        Penalties {
            presence: 0.5,
            ..neutral
        },
        Penalties {
            frequency: -0.5,
            ..neutral
        },
        Penalties {
            repetition: 1.2,
            ..neutral
        },
    ] {
        assert!(p.is_active(), "{p:?}");
    }
}

#[test]
fn logprobs_are_wanted_for_the_token_or_for_its_alternatives() {
    let base = SampleRequest {
        params: SamplingParams::greedy(),
        penalties: Penalties::default(),
        logprobs: false,
        top_logprobs: 0,
        allowed: None,
    };
    assert!(!base.wants_logprobs());
    assert!(
        SampleRequest {
            logprobs: true,
            ..base.clone()
        }
        .wants_logprobs()
    );
    assert!(
        SampleRequest {
            top_logprobs: 1,
            ..base
        }
        .wants_logprobs()
    );
}

#[test]
fn micro_batches_parse_from_their_flag_values_and_say_what_is_expected() {
    assert_eq!("auto".parse(), Ok(MicroBatches::Auto));
    assert_eq!("1".parse(), Ok(MicroBatches::One));
    assert_eq!("2".parse(), Ok(MicroBatches::Two));
    let err = "3".parse::<MicroBatches>().unwrap_err();
    assert!(err.contains("1, 2 or auto") && err.contains("`3`"), "{err}");
}

/// A node with nothing but the required methods.
struct Bare;

impl AttentionNode for Bare {
    fn kv_capacity(&self) -> KvCapacity {
        KvCapacity {
            block_size: 16,
            num_blocks: 1,
        }
    }
    fn step(&mut self, _batch: &StepBatch) -> Result<StepOutput, StepError> {
        Ok(StepOutput::default())
    }
    fn free(&mut self, _seqs: &[SeqId]) -> Result<(), StepError> {
        Ok(())
    }
}

#[test]
fn a_node_reports_no_routing_and_no_health_unless_it_says_otherwise() {
    let mut node = Bare;
    node.record_routing(true);
    assert_eq!(node.take_routing(), None);
    assert!(node.health_source().is_none());
}

#[test]
fn each_clock_says_how_it_relates_to_the_wall() {
    assert_eq!(WallClock.dilation(), 1.0);
    assert!(!WallClock.is_modeled());
    assert_eq!(VirtualClock::new().dilation(), 0.0);
    let dilated = DilatedClock::new(20.0);
    assert!(dilated.is_modeled());
    assert_eq!(dilated.dilation(), 20.0);
}

#[test]
fn routing_counts_tokens_per_moe_layer_and_none_without_experts() {
    let r = StepRouting {
        top_k: 2,
        layers: vec![Some(vec![0, 1, 2, 3, 0, 2]), None],
    };
    assert_eq!((r.tokens(0), r.tokens(1), r.tokens(2)), (3, 0, 0));
    let no_k = StepRouting {
        top_k: 0,
        layers: vec![Some(vec![0, 1])],
    };
    assert_eq!(
        no_k.tokens(0),
        0,
        "top_k 0 routes nothing (and does not divide by it)"
    );
}

#[test]
fn card_states_print_and_parse_as_their_names_and_health_lists_cards_not_up() {
    for (state, name) in [
        (CardState::Up, "up"),
        (CardState::Down, "down"),
        (CardState::Rejoining, "rejoining"),
    ] {
        assert_eq!(state.as_str(), name);
        assert_eq!(state.to_string(), name);
        assert_eq!(name.parse::<CardState>(), Ok(state));
    }
    let card = |card, state| CardHealth {
        card,
        state,
        reason: String::new(),
        for_seconds: 0.0,
        failures: 0,
        rejoins: 0,
    };
    let health = NodeHealth {
        cards: vec![
            card(0, CardState::Up),
            card(1, CardState::Down),
            card(2, CardState::Rejoining),
        ],
        unserved: None,
    };
    let not_up: Vec<usize> = health.not_up().map(|c| c.card).collect();
    assert_eq!(not_up, vec![1, 2]);
}
