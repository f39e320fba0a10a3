//! The node against the reference, with in-memory cards that compute the expert math with the
//! model crate's own functions (the real cards come from corsair-ffn).

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Duration;

use model::config::FfnKind;
use model::forward::moe::gated_mlp;
use model::generate::{GenerationRequest, generate};
use model::sampling::{self, SamplingParams};
use model::weights::{ExpertFilter, FfnWeights, LoadOptions};
use model::{ModelWeights, ReferenceModel};
use proto::data::{self, Candidate, Immediate, Kind, Proposal};

use super::*;
use crate::cards::{CardBoard, Heartbeat};
use crate::dispatch::ExpertPlacement;
use crate::fabric::{CardFabric, Reply};
use step::{InvalidStep, Penalties, SampleRequest, StepEntry, TokenMask};

/// Cards in memory: card `c` holds experts `e % cards == c` (every expert when `replicated`)
/// and a contiguous vocabulary slice.
struct MemoryCards {
    weights: ModelWeights,
    cards: usize,
    vocab: Vec<Range<u32>>,
    queue: VecDeque<Reply>,
    replicated: bool,
    /// A card that dies at the first message it is sent: the message is lost and the board
    /// hears of it, as from a failed heartbeat.
    dies: Option<(usize, Arc<std::sync::OnceLock<Arc<CardBoard>>>)>,
}

impl MemoryCards {
    fn reply(&mut self, card: usize, immediate: Immediate, bytes: Vec<u8>) {
        self.queue.push_back(Reply {
            card,
            immediate,
            bytes,
        });
    }
}

impl CardFabric for MemoryCards {
    fn cards(&self) -> usize {
        self.cards
    }

    fn send(
        &mut self,
        card: usize,
        _mb: u8,
        message: Vec<u8>,
        immediate: Immediate,
    ) -> Result<(), StepError> {
        if let Some((dead, board)) = &self.dies
            && *dead == card
        {
            if let Some(board) = board.get() {
                board.missed(card, "connection refused", true);
            }
            return Ok(());
        }
        let h = data::decode_header(&message).unwrap();
        let meta = data::MessageMeta {
            step: h.step,
            layer: h.layer,
            micro_batch: h.micro_batch,
            dtype: h.dtype,
            shard: h.shard,
        };
        let cfg = self.weights.config.clone();
        let hidden = cfg.hidden_size;
        let mut out = Vec::new();
        match h.kind {
            Kind::MoeDispatch => {
                let d = data::decode_moe_dispatch(&message).unwrap();
                let rows = d.rows.to_f32();
                let FfnWeights::Moe(moe) = &self.weights.layers[h.layer as usize].ffn else {
                    panic!("not MoE")
                };
                let act = cfg.moe.unwrap().activation;
                let mut partial = vec![0f32; rows.len()];
                for t in 0..h.tokens as usize {
                    let x = &rows[t * hidden..(t + 1) * hidden];
                    for s in 0..h.slots as usize {
                        let e = d.expert(t, s);
                        if e == data::NO_EXPERT {
                            continue;
                        }
                        assert!(
                            self.replicated || e as usize % self.cards == card,
                            "expert sent to the wrong card"
                        );
                        let y = gated_mlp(moe.expert(e as usize).unwrap(), act, x, 1);
                        for (p, v) in partial[t * hidden..(t + 1) * hidden].iter_mut().zip(y) {
                            *p += v * d.weight(t, s);
                        }
                    }
                }
                data::encode_rows(Kind::PartialSums, meta, hidden, &partial, &mut out);
            }
            Kind::DenseDispatch => {
                let (_, r) = data::decode_rows(&message, Kind::DenseDispatch).unwrap();
                let FfnWeights::Dense(mlp) = &self.weights.layers[h.layer as usize].ffn else {
                    panic!("not dense")
                };
                let y = gated_mlp(
                    mlp,
                    model::config::Activation::SwiGlu,
                    &r.to_f32(),
                    h.tokens as usize,
                );
                data::encode_rows(Kind::PartialSums, meta, hidden, &y, &mut out);
            }
            Kind::LmHeadDispatch => {
                let d = data::decode_lm_head_dispatch(&message).unwrap();
                let rows = d.rows.to_f32();
                let range = self.vocab[card].clone();
                let head = self
                    .weights
                    .lm_head
                    .select_rows(range.start as usize, 1, range.len());
                let n = h.tokens as usize;
                let mut logits = vec![0f32; n * range.len()];
                model::kernels::matmul(&rows, n, &head, None, &mut logits);
                let proposals: Vec<Proposal> = (0..n)
                    .map(|t| {
                        let row = &logits[t * range.len()..(t + 1) * range.len()];
                        let s = d.sampling(t);
                        let params = SamplingParams {
                            temperature: s.temperature,
                            seed: s.seed,
                            ..Default::default()
                        };
                        let mut order: Vec<usize> = (0..row.len()).collect();
                        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                        let mut winner = (f64::NEG_INFINITY, u32::MAX, 0f32);
                        if s.temperature > 0.0 {
                            for (i, &l) in row.iter().enumerate() {
                                let tok = range.start + i as u32;
                                let score = sampling::gumbel_score(l, &params, s.position, tok);
                                if score > winner.0 {
                                    winner = (score, tok, l);
                                }
                            }
                        }
                        let scaled: Vec<f32> = row.iter().map(|l| l / s.temperature).collect();
                        Proposal {
                            log_sum_exp: Some(sampling::log_sum_exp(row)),
                            scaled_log_sum_exp: (s.temperature > 0.0)
                                .then(|| sampling::log_sum_exp(&scaled)),
                            winner: (s.temperature > 0.0).then_some(proto::data::Winner {
                                token: winner.1,
                                logit: winner.2,
                                score: winner.0,
                            }),
                            shard_rows: row.len() as u32,
                            candidates: order
                                .iter()
                                .take(h.slots as usize)
                                .map(|&i| Candidate {
                                    logit: row[i],
                                    token: range.start + i as u32,
                                })
                                .collect(),
                            target_logit: None,
                        }
                    })
                    .collect();
                data::encode_proposals(meta, h.slots as usize, &proposals, &mut out);
            }
            other => panic!("unexpected {other:?}"),
        }
        self.reply(card, immediate, out);
        Ok(())
    }

    fn recv(&mut self, _timeout: Duration) -> Result<Reply, StepError> {
        self.queue.pop_front().ok_or(StepError::NoReply {
            waited: _timeout,
            reason: "nothing to receive".into(),
        })
    }

    fn traffic(&self) -> (u64, u64) {
        (0, 0)
    }
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

fn node(dir: &std::path::Path, cards: usize, micro_batches: MicroBatches) -> DisaggregatedNode {
    node_on(dir, cards, micro_batches, AttentionDevice::Cpu)
}

fn node_on(
    dir: &std::path::Path,
    cards: usize,
    micro_batches: MicroBatches,
    device: AttentionDevice,
) -> DisaggregatedNode {
    node_with(dir, cards, micro_batches, device, Setup::default())
}

/// How a test node differs from the plain one.
#[derive(Default)]
struct Setup {
    /// Every card holds every expert.
    replicated: bool,
    /// This card goes down in the middle of a step.
    dies: Option<usize>,
    /// [`NodeConfig::solo_threads`].
    solo_threads: usize,
    /// [`NodeConfig::max_tokens`], when not the default.
    max_tokens: Option<usize>,
}

/// A node on `device` with its cards set up as `setup` says.
fn node_with(
    dir: &std::path::Path,
    cards: usize,
    micro_batches: MicroBatches,
    device: AttentionDevice,
    setup: Setup,
) -> DisaggregatedNode {
    let Setup {
        replicated,
        dies,
        solo_threads,
        max_tokens,
    } = setup;
    let all = ModelWeights::load(dir).unwrap();
    let attn = ModelWeights::load_with(
        dir,
        &LoadOptions {
            experts: ExpertFilter::None,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let cfg = &all.config;
    let experts = cfg.moe.map_or(0, |m| m.num_experts);
    let card_experts: Vec<Vec<Vec<u32>>> = (0..cards)
        .map(|c| {
            (0..cfg.num_layers())
                .map(|l| {
                    if cfg.layers[l].ffn == FfnKind::Moe {
                        (0..experts as u32)
                            .filter(|e| replicated || *e as usize % cards == c)
                            .collect()
                    } else {
                        Vec::new()
                    }
                })
                .collect()
        })
        .collect();
    let moe_layers: Vec<bool> = cfg.layers.iter().map(|l| l.ffn == FfnKind::Moe).collect();
    let per = (cfg.vocab_size as u32).div_ceil(cards as u32);
    let vocab: Vec<Range<u32>> = (0..cards as u32)
        .map(|c| (c * per).min(cfg.vocab_size as u32)..((c + 1) * per).min(cfg.vocab_size as u32))
        .collect();
    let layout = CardLayout {
        placement: ExpertPlacement::new(cfg.num_layers(), experts, &moe_layers, &card_experts)
            .unwrap(),
        dense_cards: vec![0],
        lm_head: vocab.clone(),
    };
    let board = Arc::new(std::sync::OnceLock::new());
    let fabric = MemoryCards {
        weights: all,
        cards,
        vocab,
        queue: VecDeque::new(),
        replicated,
        dies: dies.map(|c| (c, board.clone())),
    };
    let config = NodeConfig {
        device,
        micro_batches,
        lm_head_candidates: 4,
        solo_threads,
        max_tokens: max_tokens.unwrap_or(NodeConfig::default().max_tokens),
        kv: crate::kv_cache::KvCacheConfig {
            block_size: 4,
            memory_bytes: 4 << 20,
            gpu_memory_utilization: None,
        },
        ..NodeConfig::default()
    };
    let node = DisaggregatedNode::new(&attn, layout, Box::new(fabric), config).unwrap();
    let _ = board.set(node.board());
    node
}

/// One request per prompt, without stop tokens.
fn requests(
    prompts: &[Vec<u32>],
    max_tokens: usize,
    params: SamplingParams,
) -> Vec<GenerationRequest> {
    prompts
        .iter()
        .map(|p| GenerationRequest {
            prompt: p.clone(),
            max_tokens,
            sampling: params,
            stop_token_ids: vec![],
        })
        .collect()
}

/// Generation of several prompts together through the node's step API.
fn run(
    node: &mut DisaggregatedNode,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    params: SamplingParams,
) -> Vec<Vec<u32>> {
    let requests = requests(prompts, max_tokens, params);
    crate::driver::generate(node, &requests, 100)
        .unwrap()
        .into_iter()
        .map(|g| g.output_ids)
        .collect()
}

fn reference(
    dir: &std::path::Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    params: SamplingParams,
) -> Vec<Vec<u32>> {
    let mut m = ReferenceModel::new(ModelWeights::load(dir).unwrap()).unwrap();
    let requests = requests(prompts, max_tokens, params);
    generate(&mut m, &requests, 0)
        .unwrap()
        .into_iter()
        .map(|g| g.output_ids)
        .collect()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 99, 3, 42, 8, 77, 12, 1, 30],
        vec![7, 7, 200],
        vec![64, 32, 16, 8, 4, 2],
    ]
}

#[test]
fn greedy_matches_the_reference_for_every_family_card_count_and_overlap() {
    for name in [
        "gpt-oss-bf16",
        "gpt-oss-mxfp4",
        "mixtral",
        "qwen3-moe-fused",
    ] {
        let dir = fixture(name);
        let expected = reference(&dir, &prompts(), 8, SamplingParams::greedy());
        for cards in [1, 2, 3] {
            for mb in [MicroBatches::One, MicroBatches::Two] {
                let mut n = node(&dir, cards, mb);
                assert_eq!(
                    run(&mut n, &prompts(), 8, SamplingParams::greedy()),
                    expected,
                    "{name} cards {cards} {mb:?}"
                );
            }
        }
    }
}

#[test]
fn seeded_sampling_is_the_same_for_every_card_count() {
    let dir = fixture("gpt-oss-mxfp4");
    let params = SamplingParams {
        temperature: 0.8,
        seed: 1234,
        ..Default::default()
    };
    let expected = reference(&dir, &prompts(), 6, params);
    for cards in [1, 2, 4] {
        let mut n = node(&dir, cards, MicroBatches::Auto);
        assert_eq!(
            run(&mut n, &prompts(), 6, params),
            expected,
            "cards {cards}"
        );
    }
    // Nucleus sampling goes through the full-logits fallback and still matches.
    let nucleus = SamplingParams {
        temperature: 0.9,
        top_p: 0.8,
        seed: 7,
        ..Default::default()
    };
    let expected = reference(&dir, &prompts(), 4, nucleus);
    let mut n = node(&dir, 3, MicroBatches::Two);
    assert_eq!(run(&mut n, &prompts(), 4, nucleus), expected);
    assert!(n.stats().full_logits_rows > 0);
}

#[test]
fn a_sequence_gives_the_same_tokens_alone_and_in_a_batch() {
    let dir = fixture("qwen3-moe");
    let all = prompts();
    let mut n = node(&dir, 2, MicroBatches::Auto);
    let batched = run(&mut n, &all, 6, SamplingParams::greedy());
    for (i, p) in all.iter().enumerate() {
        let mut n = node(&dir, 2, MicroBatches::Auto);
        assert_eq!(
            run(&mut n, std::slice::from_ref(p), 6, SamplingParams::greedy())[0],
            batched[i]
        );
    }
}

/// The device path on candle's CPU device (what `--device cuda` runs, with the custom ops' CPU
/// implementations) gives the reference's greedy tokens for every family, card count and micro-batching,
/// and the host path's logits.
#[test]
fn the_device_path_matches_the_reference_and_the_host_path() {
    for name in [
        "gpt-oss-bf16",
        "gpt-oss-mxfp4",
        "mixtral",
        "mixtral-sliding",
        "qwen3-moe",
        "qwen3-moe-fused",
    ] {
        let dir = fixture(name);
        let expected = reference(&dir, &prompts(), 8, SamplingParams::greedy());
        for (cards, mb) in [
            (1, MicroBatches::One),
            (2, MicroBatches::Two),
            (3, MicroBatches::Auto),
        ] {
            let mut n = node_on(&dir, cards, mb, AttentionDevice::CandleCpu);
            assert_eq!(
                run(&mut n, &prompts(), 8, SamplingParams::greedy()),
                expected,
                "{name} cards {cards} {mb:?}"
            );
        }
        let logits = |device| {
            let mut n = node_on(&dir, 2, MicroBatches::Two, device);
            n.collect_logits(true);
            let tokens = run(&mut n, &prompts(), 6, SamplingParams::greedy());
            (tokens, n.take_logits())
        };
        let (host_tokens, host) = logits(AttentionDevice::Cpu);
        let (device_tokens, device) = logits(AttentionDevice::CandleCpu);
        assert_eq!(host_tokens, device_tokens, "{name}");
        assert_eq!(host.len(), device.len(), "{name}");
        let worst = host
            .iter()
            .zip(&device)
            .map(|((s1, a), (s2, b))| {
                assert_eq!(s1, s2);
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            })
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{name}: logits differ by {worst}");
    }
}

#[test]
fn replicas_and_the_nodes_lm_head_cover_a_down_card_with_the_same_tokens() {
    let dir = fixture("gpt-oss-mxfp4");
    let expected = reference(&dir, &prompts(), 8, SamplingParams::greedy());
    let setup = Setup {
        replicated: true,
        ..Setup::default()
    };
    let mut n = node_with(&dir, 2, MicroBatches::Two, AttentionDevice::Cpu, setup);
    n.board().missed(1, "connection refused", true);
    assert_eq!(
        run(&mut n, &prompts(), 8, SamplingParams::greedy()),
        expected
    );
    // Card 1's vocabulary rows came from the node, through the full-logits round.
    assert!(n.stats().full_logits_rows > 0);
    // Back: a rejoin hands over an inbox, and the proposals round is used again.
    let board = n.board();
    let beat = Heartbeat {
        incarnation: 1,
        serves_us: false,
    };
    assert_eq!(board.heartbeat(1, beat), crate::cards::Action::Rejoin);
    board.rejoined(
        1,
        1,
        jetstream::RegionDescriptor {
            node: "card-1".into(),
            id: 1,
            len: 1,
            key: 1,
        },
    );
    let rows = n.stats().full_logits_rows;
    assert_eq!(
        run(&mut n, &prompts(), 8, SamplingParams::greedy()),
        expected
    );
    assert_eq!(n.stats().full_logits_rows, rows);
}

#[test]
fn a_down_card_without_cover_fails_the_step_at_once_naming_it() {
    let dir = fixture("gpt-oss-mxfp4");
    let mut n = node(&dir, 2, MicroBatches::Auto);
    n.board().missed(1, "connection refused", true);
    let started = std::time::Instant::now();
    let requests = [GenerationRequest {
        prompt: prompts()[0].clone(),
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
    }];
    let err = crate::driver::generate(&mut n, &requests, 100)
        .unwrap_err()
        .to_string();
    assert!(err.contains("card 1 is down"), "{err}");
    assert!(err.contains("connection refused"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_card_that_dies_during_a_step_is_replaced_by_its_replica_in_a_second_try() {
    let dir = fixture("gpt-oss-mxfp4");
    let expected = reference(&dir, &prompts(), 6, SamplingParams::greedy());
    let setup = Setup {
        replicated: true,
        dies: Some(1),
        ..Setup::default()
    };
    let mut n = node_with(&dir, 2, MicroBatches::Auto, AttentionDevice::Cpu, setup);
    assert_eq!(
        run(&mut n, &prompts(), 6, SamplingParams::greedy()),
        expected
    );
    assert_eq!(n.stats().retried_steps, 1);
    assert_eq!(n.board().live().down, vec![1]);
}

/// A node that takes fewer tokens a step than a prompt holds refuses the prompt whole; the
/// driver's chunked prefill gives the reference's tokens, no step over the node's limit.
#[test]
fn prompts_longer_than_a_step_are_prefilled_in_chunks() {
    let dir = fixture("gpt-oss-mxfp4");
    let expected = reference(&dir, &prompts(), 5, SamplingParams::greedy());
    let setup = Setup {
        max_tokens: Some(4),
        ..Setup::default()
    };
    let mut n = node_with(&dir, 2, MicroBatches::Auto, AttentionDevice::Cpu, setup);
    let requests = requests(&prompts(), 5, SamplingParams::greedy());
    let whole = crate::driver::generate(&mut n, &requests, 0);
    assert!(
        matches!(
            &whole,
            Err(StepError::Invalid(InvalidStep::TooManyTokens {
                max_tokens: 4,
                ..
            }))
        ),
        "{whole:?}"
    );
    let steps = n.stats().steps;
    let chunked = crate::driver::generate_in_chunks(&mut n, &requests, 100, 4).unwrap();
    let tokens: Vec<Vec<u32>> = chunked.into_iter().map(|g| g.output_ids).collect();
    assert_eq!(tokens, expected);
    // 19 prompt tokens take at least 5 steps of 4, then 4 decode steps for the other tokens.
    assert!(n.stats().steps - steps >= 9, "{:?}", n.stats());
    assert_eq!(
        crate::driver::generate_in_chunks(&mut n, &requests, 200, 0)
            .err()
            .map(|e| e.to_string().contains("--max-num-batched-tokens")),
        Some(true)
    );
}

/// The prompts as one prefill step, each sampling as `sample(i)` says.
fn prefill(prompts: &[Vec<u32>], sample: impl Fn(usize) -> SampleRequest) -> StepBatch {
    StepBatch {
        entries: prompts
            .iter()
            .enumerate()
            .map(|(i, p)| StepEntry {
                seq: i as SeqId,
                tokens: p.clone(),
                start: 0,
                prompt_len: p.len(),
                block_table: (4 * i as u32..4 * i as u32 + 4).collect(),
                sample: Some(sample(i)),
                cached_prefix: Vec::new(),
                prompt_logprobs: None,
            })
            .collect(),
    }
}

/// A handle filled with `mask` from another thread a little later, as the router's mask
/// thread fills it while the step runs.
fn filled_later(mask: TokenMask) -> step::AllowedTokens {
    let handle = step::AllowedTokens::pending();
    let filler = handle.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        filler.fill(Ok(mask));
    });
    handle
}

/// Structured output through the sharded LM head: a greedy row whose mask refuses the
/// unconstrained choice gets the second best token of the full logits, decided from the cards'
/// candidates (no full-logits round), with the unconstrained logprob and alternatives; a
/// sampled row under a mask gathers the full logits and draws an allowed token.
#[test]
fn a_constrained_row_samples_the_best_allowed_token_through_the_lm_head() {
    let dir = fixture("gpt-oss-mxfp4");
    let prompts = prompts();
    let free = |_| SampleRequest {
        params: SamplingParams::greedy(),
        penalties: Penalties::default(),
        logprobs: true,
        top_logprobs: 2,
        allowed: None,
    };
    let mut n = node(&dir, 3, MicroBatches::Auto);
    n.collect_logits(true);
    let unconstrained = n.step(&prefill(&prompts, free)).unwrap().sampled;
    let logits = n.take_logits();
    let vocab = n.config().vocab_size;
    assert_eq!(logits.len(), prompts.len());

    let without = |t: u32| TokenMask::from_tokens(vocab, (0..vocab as u32).filter(|&u| u != t));
    let mut n = node(&dir, 3, MicroBatches::Auto);
    let constrained = n
        .step(&prefill(&prompts, |i| SampleRequest {
            allowed: Some(filled_later(without(unconstrained[i].token))),
            ..free(i)
        }))
        .unwrap()
        .sampled;
    assert_eq!(n.stats().full_logits_rows, 0, "decided from the candidates");
    for ((free, got), (seq, row)) in unconstrained.iter().zip(&constrained).zip(&logits) {
        assert_eq!(got.seq, *seq);
        let raw = sampling::log_softmax(row);
        let mut second = row.clone();
        second[free.token as usize] = f32::NEG_INFINITY;
        let expected = sampling::argmax(&second);
        assert_ne!(expected, free.token);
        assert_eq!(got.token, expected, "sequence {seq}");
        assert!((got.logprob - raw[expected as usize]).abs() < 1e-4);
        assert_eq!(got.top_logprobs, free.top_logprobs);
    }

    // Sampled under a mask of every fifth token: gathered, and always allowed.
    let fifth = TokenMask::from_tokens(vocab, (0..vocab as u32).filter(|t| t % 5 == 1));
    let mut n = node(&dir, 3, MicroBatches::Auto);
    let sampled = n
        .step(&prefill(&prompts, |i| SampleRequest {
            params: SamplingParams {
                temperature: 0.9,
                seed: 5 + i as u64,
                ..Default::default()
            },
            allowed: Some(filled_later(fifth.clone())),
            ..free(i)
        }))
        .unwrap()
        .sampled;
    assert_eq!(n.stats().full_logits_rows, prompts.len() as u64);
    for (got, (_, row)) in sampled.iter().zip(&logits) {
        assert!(fifth.allows(got.token), "{}", got.token);
        let raw = sampling::log_softmax(row);
        assert!((got.logprob - raw[got.token as usize]).abs() < 1e-4);
    }

    // A mask whose computation failed fails the step.
    let failed = step::AllowedTokens::pending();
    failed.fill(Err("the grammar broke".into()));
    let mut n = node(&dir, 2, MicroBatches::Auto);
    let err = n
        .step(&prefill(&prompts[..1], |i| SampleRequest {
            allowed: Some(failed.clone()),
            ..free(i)
        }))
        .unwrap_err();
    assert!(err.to_string().contains("the grammar broke"), "{err}");
}

mod pools;
