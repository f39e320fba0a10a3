//! `--activation-dtype bf16` end to end in one process: the cards (bf16 programs over
//! JetStream) against the monolithic reference forward with the same setting, on every
//! transformers fixture, and how close both stay to the fixtures' own tokens.

use std::path::Path;

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::driver;
use model::kernels::ActivationDtype;
use model::weights::LoadOptions;

mod common;

use common::{expected, fixtures, greedy_requests};

fn bf16_weights(dir: &Path) -> model::ModelWeights {
    model::ModelWeights::load_with(
        dir,
        &LoadOptions {
            activations: ActivationDtype::Bf16,
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

/// Greedy tokens that `got` shares with `want` before the first difference, and `want`'s length.
fn agreement(got: &[u32], want: &[u32]) -> (usize, usize) {
    let same = got.iter().zip(want).take_while(|(a, b)| a == b).count();
    (same, want.len())
}

fn add(total: &mut (usize, usize), (same, len): (usize, usize)) {
    total.0 += same;
    total.1 += len;
}

/// With f32 activations the cards give the reference's greedy tokens exactly (`pipeline.rs`);
/// with bf16 both round the same inputs, but the cards sum partials in another order (segments,
/// experts across cards), so near-ties may resolve differently: agreement is measured, and must
/// stay high, against the bf16 reference and against the fixtures' (f32 transformers) tokens.
#[test]
fn bf16_cards_keep_close_to_the_bf16_reference_and_the_fixtures() {
    let (mut vs_reference, mut vs_fixture) = ((0, 0), (0, 0));
    for dir in fixtures() {
        let cases = expected(&dir);
        let requests = greedy_requests(&cases);
        let mut reference = model::ReferenceModel::new(bf16_weights(&dir)).unwrap();
        let want: Vec<Vec<u32>> = model::generate::generate(&mut reference, &requests, 0)
            .unwrap()
            .into_iter()
            .map(|g| g.output_ids)
            .collect();
        for (w, (_, fixture)) in want.iter().zip(&cases) {
            add(&mut vs_fixture, agreement(w, fixture));
        }
        for cards in [1, 3] {
            let mut config = ClusterConfig::new(&dir, cards);
            config.transport = TransportKind::Inproc;
            config.node.kv.memory_bytes = 8 << 20;
            config.activation_dtype = ActivationDtype::Bf16;
            let mut c = EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
            let mut node = c.take_nodes().remove(0);
            let got = driver::generate(&mut node, &requests, 0).unwrap();
            for (g, w) in got.iter().zip(&want) {
                // Every prompt starts the same: the first token has no earlier near-tie.
                assert_eq!(
                    g.output_ids.first(),
                    w.first(),
                    "{} {cards} cards",
                    dir.display()
                );
                add(&mut vs_reference, agreement(&g.output_ids, w));
            }
        }
    }
    eprintln!(
        "bf16 activations: cards keep {} of {} reference tokens, the reference {} of {} \
         fixture tokens (before each sequence's first difference)",
        vs_reference.0, vs_reference.1, vs_fixture.0, vs_fixture.1
    );
    assert!(
        vs_reference.0 * 10 >= vs_reference.1 * 9,
        "{vs_reference:?}"
    );
    assert!(vs_fixture.0 * 2 > vs_fixture.1, "{vs_fixture:?}");
}
