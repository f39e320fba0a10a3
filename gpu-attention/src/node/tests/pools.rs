//! How the node spends its host's cores: the wide pool of single-micro-batch steps, and the
//! choice between one and two micro-batches under `auto`.

use super::*;

/// Steps of one micro-batch compute their attention on a pool wider than the process's, and
/// give the same logits, bit for bit, as on the process's pool (each output row of a product
/// is one task's sum, whatever the thread count).
#[test]
fn a_wider_pool_for_single_micro_batch_steps_gives_the_same_logits() {
    let dir = fixture("gpt-oss-mxfp4");
    let wider = rayon::current_num_threads() + 1;
    let logits = |solo: bool, mb: MicroBatches| {
        let setup = Setup {
            solo_threads: if solo { wider } else { 0 },
            ..Setup::default()
        };
        let mut n = node_with(&dir, 2, mb, AttentionDevice::Cpu, setup);
        assert_eq!(n.solo_pool.is_some(), solo);
        // The fixture's attention is far too little work for the node to take the pool
        // itself.
        n.solo_min_work = 0;
        n.collect_logits(true);
        let tokens = run(&mut n, &prompts(), 6, SamplingParams::greedy());
        // The pool computed every layer of the steps of one micro-batch, and no other.
        let layers = n.config().num_layers() as u64;
        let expected = match mb {
            MicroBatches::One if solo => n.stats().steps * layers,
            _ => 0,
        };
        assert_eq!(n.stats().solo_layers, expected, "{mb:?}");
        (tokens, n.take_logits())
    };
    let plain = logits(false, MicroBatches::One);
    assert_eq!(
        plain.0,
        reference(&dir, &prompts(), 6, SamplingParams::greedy())
    );
    assert_eq!(logits(true, MicroBatches::One), plain);
    // Two micro-batches keep to the process's pool, with the same result.
    assert_eq!(logits(true, MicroBatches::Two), plain);
}

/// With the pool there, the node still keeps steps of little attention work off it: the
/// fixture's steps never take it.
#[test]
fn steps_of_little_attention_work_keep_to_the_process_pool() {
    let dir = fixture("gpt-oss-mxfp4");
    let setup = Setup {
        solo_threads: rayon::current_num_threads() + 1,
        ..Setup::default()
    };
    let mut n = node_with(&dir, 2, MicroBatches::One, AttentionDevice::Cpu, setup);
    assert!(n.solo_pool.is_some());
    run(&mut n, &prompts(), 4, SamplingParams::greedy());
    assert!(n.stats().steps > 0);
    assert_eq!(n.stats().solo_layers, 0);
}

/// GPT-OSS-20B's attention (2880 wide, 64 query and 8 key-value heads of 64) and a medium
/// Mixtral's (768 wide, 12 and 4 heads of 64) take the wider pool from one token on; a model
/// a third as wide (256, 4 and 2 heads of 64) only for steps of several tokens.
#[test]
fn steps_take_the_wider_pool_by_their_attention_work() {
    let dir = fixture("gpt-oss-mxfp4");
    let mut config = ModelWeights::load(&dir).unwrap().config;
    let mut work = |hidden, heads, kv_heads, tokens| {
        config.hidden_size = hidden;
        config.num_heads = heads;
        config.num_kv_heads = kv_heads;
        config.head_dim = 64;
        crate::node::host_threads::attention_work(&config, tokens)
    };
    let min = crate::node::host_threads::SOLO_MIN_LAYER_WORK;
    assert_eq!(work(2880, 64, 8, 1), 2880 * 2 * (4096 + 512));
    assert!(work(2880, 64, 8, 1) >= min);
    assert!(work(768, 12, 4, 1) >= min);
    assert!(work(256, 4, 2, 1) < min);
    assert!(work(256, 4, 2, 16) >= min);
}

/// Under `auto` the node tries steps of both one and two micro-batches (each step size on its
/// own), and whichever it runs, the tokens are the reference's.
#[test]
fn auto_tries_one_and_two_micro_batches_with_the_reference_tokens() {
    let dir = fixture("gpt-oss-mxfp4");
    let expected = reference(&dir, &prompts(), 8, SamplingParams::greedy());
    let mut n = node(&dir, 2, MicroBatches::Auto);
    assert_eq!(
        run(&mut n, &prompts(), 8, SamplingParams::greedy()),
        expected
    );
    let stats = n.stats();
    // The prefill (two, the first of its size class), then 7 decode steps of one class,
    // whose warm-up runs two, then one.
    assert!(stats.two_micro_batch_steps >= 2, "{stats:?}");
    assert!(stats.steps - stats.two_micro_batch_steps >= 1, "{stats:?}");
    // Fixed settings run what they say.
    for (mb, twos) in [(MicroBatches::One, 0), (MicroBatches::Two, 8)] {
        let mut n = node(&dir, 2, mb);
        assert_eq!(
            run(&mut n, &prompts(), 8, SamplingParams::greedy()),
            expected
        );
        assert_eq!(n.stats().two_micro_batch_steps, twos, "{mb:?}");
    }
}

#[test]
fn attention_threads_as_many_as_the_cpus_each_run_on_one() {
    // The CPUs the calling thread may run on.
    let allowed = || -> Vec<usize> {
        core_affinity::get_core_ids()
            .unwrap_or_default()
            .iter()
            .map(|c| c.id)
            .collect()
    };
    let cpus = allowed();
    if cpus.len() < 2 {
        test_skips::skipped(&format!(
            "the process may run on {} CPU(s); pinning needs 2 (CI's machines have them)",
            cpus.len()
        ));
        return;
    }
    let on_cpus = |pool: &rayon::ThreadPool| -> Vec<Vec<usize>> {
        let mut seen: Vec<Vec<usize>> = pool.broadcast(|_| allowed());
        seen.sort();
        seen
    };
    let wide = crate::node::host_threads::compute_pool(cpus.len()).expect("an attention pool");
    let one_each: Vec<Vec<usize>> = cpus.iter().map(|&c| vec![c]).collect();
    assert_eq!(on_cpus(&wide), one_each, "one CPU each, every CPU once");
    // A narrower pool is left where the OS puts it.
    let narrow =
        crate::node::host_threads::compute_pool(cpus.len() - 1).expect("an attention pool");
    assert!(on_cpus(&narrow).iter().all(|seen| *seen == cpus));
}
