//! Moving experts while serving (`--eplb`): a move staged on the cards while the node steps,
//! switched between two steps, keeps every greedy token transformers gives and frees the old
//! shard versions; a move that fails half way leaves the old placement serving; a node and a
//! card that disagree on the version fail the step clearly.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use deploy::cluster::{CardControl, ClusterConfig, EmbeddedCluster, TransportKind};
use deploy::eplb::{MoveOutcome, MoveTargets, Rebalancer};
use deploy::error::{Error, Result};
use deploy::watch::HeartbeatError;
use gpu_attention::DisaggregatedNode;
use gpu_attention::driver;
use planner::balance::ExpertLoad;
use planner::eplb::EplbSettings;
use proto::control::{
    HealthReply, LoadShardReply, LoadShardRequest, ReleaseShardsReply, ReleaseShardsRequest,
    StageShardReply, StageShardRequest,
};

mod common;

use common::{expected, fixture, greedy_requests};

/// Every MoE layer's tokens mostly to experts 0 and 1, which the contiguous placement puts
/// on card 0.
fn skewed_load(dir: &Path) -> ExpertLoad {
    let config = model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let experts = config.moe.unwrap().num_experts;
    ExpertLoad {
        layers: config
            .moe_layers()
            .iter()
            .map(|&moe| {
                if !moe {
                    return Vec::new();
                }
                (0..experts)
                    .map(|e| match e {
                        0 => 1000,
                        1 => 600,
                        _ => 20,
                    })
                    .collect()
            })
            .collect(),
    }
}

/// `dir`'s model on 2 cards over loopback QUIC, one copy of each expert.
fn cluster(dir: &Path) -> (EmbeddedCluster, DisaggregatedNode) {
    let mut config = ClusterConfig::new(dir, 2);
    config.transport = TransportKind::Quic;
    config.node.kv.memory_bytes = 8 << 20;
    config.replicate_experts = planner::ReplicateExperts::Never;
    let mut cluster = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
    let node = cluster.take_nodes().remove(0);
    (cluster, node)
}

fn settings() -> EplbSettings {
    EplbSettings {
        num_redundant_experts: 2,
        ..EplbSettings::default()
    }
}

fn versions(cluster: &EmbeddedCluster) -> Vec<Vec<u32>> {
    cluster
        .cards
        .iter()
        .map(|c| c.health().shard_versions)
        .collect()
}

/// Generates the fixture's cases and checks every token against transformers'.
fn generate_checked(node: &mut DisaggregatedNode, cases: &[(Vec<u32>, Vec<u32>)], round: usize) {
    let got = driver::generate(node, &greedy_requests(cases), 0).unwrap();
    for (i, (g, (_, want))) in got.iter().zip(cases).enumerate() {
        assert_eq!(&g.output_ids, want, "round {round}, prompt {i}");
    }
}

#[test]
fn a_live_move_keeps_every_token_and_frees_the_old_shards() {
    let dir = fixture("gpt-oss-mxfp4");
    let (cluster, mut node) = cluster(&dir);
    let cases = expected(&dir);
    let started_with = cluster.book.current().1;
    let rebalancer = Arc::new(Rebalancer::new(
        cluster.move_targets(),
        vec![node.board()],
        settings(),
    ));
    // The move runs beside the generation: the cards stage while the node steps, and the
    // node switches between two of its steps.
    let mover = {
        let (r, load) = (Arc::clone(&rebalancer), skewed_load(&dir));
        std::thread::spawn(move || r.rebalance(&load))
    };
    let mut round = 0;
    while !mover.is_finished() {
        generate_checked(&mut node, &cases, round);
        round += 1;
        assert!(round < 500, "the move never finished");
    }
    let outcome = mover.join().unwrap().unwrap();
    let MoveOutcome::Moved {
        version,
        before,
        after,
    } = outcome
    else {
        panic!("a skewed load did not move the experts: {outcome:?}");
    };
    assert_eq!(version, 1);
    assert!(after > before, "{before} -> {after}");
    // After the switch: the new placement serves, tokens unchanged.
    generate_checked(&mut node, &cases, round);
    assert_eq!(node.board().shard_version(), 1);
    let (book_version, now) = cluster.book.current();
    assert_eq!(book_version, 1);
    assert_ne!(now, started_with, "the shares did not change");
    // The two hot experts now have a copy on each card.
    let placement = node.board().placement();
    let moe = node.config().moe_layers();
    for (layer, _) in moe.iter().enumerate().filter(|(_, m)| **m) {
        for share in &now {
            let corsair_ffn::assignment::LayerShare::Moe { experts } = &share.layers[layer] else {
                panic!("layer {layer} is not MoE on card {}", share.card);
            };
            assert!(
                experts.contains(&0) && experts.contains(&1),
                "card {} layer {layer}: {experts:?} ({placement:?})",
                share.card
            );
        }
    }
    // The old version is gone from every card.
    assert_eq!(versions(&cluster), vec![vec![1], vec![1]]);
    // The same load again: nothing more to gain.
    let again = rebalancer.rebalance(&skewed_load(&dir)).unwrap();
    assert!(matches!(again, MoveOutcome::Stayed { .. }), "{again:?}");
    assert_eq!(rebalancer.stats().moves, 1);
}

/// A card's control plane whose staging fails (a share that does not fit, a card lost).
struct FailingStage(Arc<dyn CardControl>);

impl CardControl for FailingStage {
    fn load_shard(&self, request: LoadShardRequest) -> Result<LoadShardReply> {
        self.0.load_shard(request)
    }
    fn stage_shard(&self, request: StageShardRequest) -> Result<StageShardReply> {
        Err(Error::Card {
            card: request.card_index as usize,
            message: "out of SRAM (injected)".into(),
        })
    }
    fn release_shards(&self, request: ReleaseShardsRequest) -> Result<ReleaseShardsReply> {
        self.0.release_shards(request)
    }
    fn health(&self, timeout: Duration) -> std::result::Result<HealthReply, HeartbeatError> {
        self.0.health(timeout)
    }
}

#[test]
fn a_move_that_fails_half_way_leaves_the_old_placement_serving() {
    let dir = fixture("gpt-oss-mxfp4");
    let (cluster, mut node) = cluster(&dir);
    let cases = expected(&dir);
    let mut targets: MoveTargets = cluster.move_targets();
    // Card 0 stages, card 1 fails: card 0's staged version must be freed again.
    targets.cards[1] = Arc::new(FailingStage(Arc::clone(&targets.cards[1])));
    let rebalancer = Rebalancer::new(targets, vec![node.board()], settings());
    let err = rebalancer.rebalance(&skewed_load(&dir)).unwrap_err();
    assert!(err.to_string().contains("out of SRAM"), "{err}");
    assert_eq!(rebalancer.stats().failed_moves, 1);
    assert_eq!(versions(&cluster), vec![vec![0], vec![0]]);
    assert_eq!(cluster.book.current().0, 0);
    assert_eq!(node.board().shard_version(), 0);
    generate_checked(&mut node, &cases, 0);
    assert_eq!(node.board().shard_version(), 0);
}

#[test]
fn a_card_sent_a_version_it_does_not_hold_fails_the_step_with_a_clear_error() {
    let dir = fixture("gpt-oss-mxfp4");
    let (_cluster, mut node) = cluster(&dir);
    let cases = expected(&dir);
    // Switch the node to a version no card staged.
    node.board()
        .switch_placement(7, node.board().placement())
        .unwrap();
    let err = driver::generate(&mut node, &greedy_requests(&cases[..1]), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no shard version 7"), "{err}");
}

#[test]
fn eplb_flags_that_cannot_apply_are_refused_with_the_reason() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(common::AFD)
            .arg("serve")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&["--reference", "--eplb"]);
    assert!(e.contains("--reference runs the whole model"), "{e}");
    // Extra copies need a placement that places them.
    let e = run(&["--num-redundant-experts", "2"]);
    assert!(e.contains("--expert-load") && e.contains("--eplb"), "{e}");
    let e = run(&["--eplb", "--eplb-min-gain", "2"]);
    assert!(e.contains("between 0 and 1"), "{e}");
}
