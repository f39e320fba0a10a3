//! The disaggregated pipeline end to end in one process: real card programs (corsair-ffn) over
//! JetStream (QUIC on loopback and in-process) against the transformers fixtures.

use std::path::{Path, PathBuf};

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::driver;
use model::generate::GenerationRequest;
use model::sampling::SamplingParams;

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("expected.json").exists())
        .collect();
    dirs.sort();
    dirs
}

/// The fixture's prompts and transformers' greedy continuations.
fn expected(dir: &Path) -> Vec<(Vec<u32>, Vec<u32>)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["ids"]), ids(&p["output_ids"])))
        .collect()
}

fn cluster(dir: &Path, cards: usize, transport: TransportKind) -> EmbeddedCluster {
    let mut config = ClusterConfig::new(dir, cards);
    config.transport = transport;
    config.node.kv.memory_bytes = 8 << 20;
    EmbeddedCluster::start(&config, &mut |_| {}).unwrap()
}

#[test]
fn greedy_tokens_match_transformers_for_every_fixture_card_count_and_transport() {
    for dir in fixtures() {
        let cases = expected(&dir);
        let requests: Vec<GenerationRequest> = cases
            .iter()
            .map(|(p, out)| GenerationRequest {
                prompt: p.clone(),
                max_tokens: out.len(),
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
            })
            .collect();
        for transport in [TransportKind::Inproc, TransportKind::Quic] {
            for cards in 1..=4 {
                let mut c = cluster(&dir, cards, transport);
                let mut node = c.take_nodes().remove(0);
                let got = driver::generate(&mut node, &requests, 0).unwrap();
                for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
                    assert_eq!(
                        &g.output_ids,
                        want,
                        "{} prompt {i}, {cards} cards, {transport:?}",
                        dir.display()
                    );
                }
            }
        }
    }
}
