//! Checkpoint loading beyond the fixtures: every synthetic family and format, sharded files,
//! MXFP4 against its dequantized twin, batch invariance, and clear errors for broken input.

use std::path::Path;

use model::checkpoint::Checkpoint;
use model::forward::{LogitsFor, ReferenceModel, SeqChunk};
use model::synth::{Preset, SynthFormat, SynthOptions, TensorPlan, synthesize, write_safetensors};
use model::{Family, ModelWeights};

fn synth(dir: &Path, family: Family, format: Option<SynthFormat>) {
    let opts = SynthOptions {
        family,
        preset: Preset::Tiny,
        format,
        seed: 11,
        config_only: false,
    };
    synthesize(dir, &opts, &mut |_, _| {}).unwrap();
}

/// Rewrites the checkpoint in `src` into `dst` as `shards` files (plus an index when > 1),
/// with `edit` applied to each (name, dtype, shape, bytes).
fn rewrite(
    src: &Path,
    dst: &Path,
    shards: usize,
    mut edit: impl FnMut(&mut String, &mut &'static str, &mut Vec<usize>, &mut Vec<u8>) -> bool,
) {
    std::fs::create_dir_all(dst).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let ck = Checkpoint::open(src).unwrap();
    let mut tensors = Vec::new();
    for name in ck.names() {
        let t = ck.get(name).unwrap();
        let mut dtype: &'static str = match t.dtype {
            model::checkpoint::StoredDtype::F32 => "F32",
            model::checkpoint::StoredDtype::Bf16 => "BF16",
            model::checkpoint::StoredDtype::F16 => "F16",
            _ => "U8",
        };
        let mut shape = t.shape.clone();
        let mut bytes = t.bytes.as_bytes().to_vec();
        let mut name = name.to_owned();
        if edit(&mut name, &mut dtype, &mut shape, &mut bytes) {
            tensors.push((TensorPlan { name, dtype, shape }, bytes));
        }
    }
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in tensors.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
        };
        let plans: Vec<TensorPlan> = chunk.iter().map(|(p, _)| p.clone()).collect();
        write_safetensors(
            &dst.join(&file),
            &plans,
            |j, buf| {
                buf.extend_from_slice(&chunk[j].1);
                Ok(())
            },
            &mut |_| {},
        )
        .unwrap();
        for (p, _) in chunk {
            weight_map.insert(p.name.clone(), file.clone().into());
        }
    }
    if shards > 1 {
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

fn logits(dir: &Path, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut m = ReferenceModel::new(ModelWeights::load(dir).unwrap()).unwrap();
    let chunks: Vec<SeqChunk> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| SeqChunk {
            seq: i as u64,
            tokens: p.clone(),
        })
        .collect();
    m.forward(&chunks, LogitsFor::AllTokens).unwrap()
}

const PROMPTS: [&[u32]; 3] = [
    &[1, 2, 3, 4, 5, 6, 7],
    &[42],
    &[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12],
];

fn prompts() -> Vec<Vec<u32>> {
    PROMPTS.iter().map(|p| p.to_vec()).collect()
}

#[test]
fn every_family_and_format_loads_and_runs() {
    for (family, format) in [
        (Family::GptOss, SynthFormat::Bf16),
        (Family::GptOss, SynthFormat::Mxfp4),
        (Family::GptOss, SynthFormat::F32),
        (Family::Mixtral, SynthFormat::Bf16),
        (Family::Qwen3Moe, SynthFormat::Bf16),
        (Family::Qwen3Moe, SynthFormat::F32),
    ] {
        let dir = tempfile::tempdir().unwrap();
        synth(dir.path(), family, Some(format));
        let out = logits(dir.path(), &prompts());
        let vocab = ModelWeights::load(dir.path()).unwrap().config.vocab_size;
        for (o, p) in out.iter().zip(PROMPTS) {
            assert_eq!(o.len(), p.len() * vocab);
            assert!(
                o.iter().all(|v| v.is_finite()),
                "{family} {format:?}: non-finite logits"
            );
        }
    }
}

#[test]
fn a_sequence_gives_the_same_bits_alone_and_in_a_batch() {
    for family in [Family::GptOss, Family::Mixtral, Family::Qwen3Moe] {
        let dir = tempfile::tempdir().unwrap();
        synth(dir.path(), family, None);
        let batch = logits(dir.path(), &prompts());
        for (i, p) in prompts().into_iter().enumerate() {
            let alone = logits(dir.path(), &[p]);
            assert_eq!(
                alone[0], batch[i],
                "{family}: sequence {i} changed bits in a batch"
            );
        }
    }
}

/// A rayon pool of `n` threads.
fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

/// Decode steps of several sequences at once, whose attention runs side by side on a pool of
/// 2 threads, give each sequence the bits it gets decoding alone on one thread.
#[test]
fn batched_decode_on_two_threads_gives_the_bits_of_each_sequence_alone() {
    let (one, two) = (pool(1), pool(2));
    for family in [Family::GptOss, Family::Mixtral, Family::Qwen3Moe] {
        let dir = tempfile::tempdir().unwrap();
        synth(dir.path(), family, None);
        let decode = |seqs: &[usize], steps: usize| -> (Vec<Vec<Vec<f32>>>, (u64, u64)) {
            let mut m = ReferenceModel::new(ModelWeights::load(dir.path()).unwrap()).unwrap();
            let chunk = |i: usize, tokens: Vec<u32>| SeqChunk {
                seq: i as u64,
                tokens,
            };
            let prompts: Vec<SeqChunk> = seqs
                .iter()
                .map(|&i| chunk(i, prompts()[i].clone()))
                .collect();
            m.forward(&prompts, LogitsFor::LastToken).unwrap();
            let logits = (0..steps)
                .map(|s| {
                    let step: Vec<SeqChunk> = seqs
                        .iter()
                        .map(|&i| chunk(i, vec![(s * 7 + i * 3 + 1) as u32]))
                        .collect();
                    m.forward(&step, LogitsFor::LastToken).unwrap()
                })
                .collect();
            (logits, m.attention_paths())
        };
        let (together, (side_by_side, _)) = two.install(|| decode(&[0, 1, 2], 3));
        // Every layer of every decode step ran its sequences side by side.
        let layers = ModelWeights::load(dir.path()).unwrap().config.num_layers() as u64;
        assert!(
            side_by_side >= 3 * layers,
            "{family}: {side_by_side} side-by-side batches"
        );
        for i in 0..3 {
            let (alone, (alone_side, _)) = one.install(|| decode(&[i], 3));
            assert_eq!(
                alone_side, 0,
                "{family}: one sequence on one thread is never split"
            );
            for (s, (a, t)) in alone.iter().zip(&together).enumerate() {
                assert_eq!(a[0], t[i], "{family}: sequence {i}, step {s}");
            }
        }
    }
}

/// Three sequences, and one, with long histories decode on 2 threads with each row's key/value
/// heads split over them (they do not share out evenly by sequence; the split starts at 32 K
/// key floats: 1,024 positions of the tiny checkpoints' 2 x 16) and get the bits they get on
/// one thread; GPT-OSS's sliding-window layers (4 keys) stay whole between its split ones.
#[test]
fn long_sequences_split_by_heads_over_two_threads_give_the_one_thread_bits() {
    let (one, two) = (pool(1), pool(2));
    for family in [Family::GptOss, Family::Mixtral] {
        let dir = tempfile::tempdir().unwrap();
        synth(dir.path(), family, None);
        for seqs in [3u32, 1] {
            let decode = || -> (Vec<Vec<f32>>, u64) {
                let mut m = ReferenceModel::new(ModelWeights::load(dir.path()).unwrap()).unwrap();
                let prompts: Vec<SeqChunk> = (0..seqs)
                    .map(|q| SeqChunk {
                        seq: u64::from(q),
                        tokens: (0..1100 + q * 40).map(|i| (i * 37 + 5 * q) % 300).collect(),
                    })
                    .collect();
                m.forward(&prompts, LogitsFor::LastToken).unwrap();
                let logits = (0..3u32)
                    .flat_map(|s| {
                        let step: Vec<SeqChunk> = (0..seqs)
                            .map(|q| SeqChunk {
                                seq: u64::from(q),
                                tokens: vec![s * 11 + q + 2],
                            })
                            .collect();
                        m.forward(&step, LogitsFor::LastToken).unwrap()
                    })
                    .collect();
                (logits, m.attention_paths().1)
            };
            let (alone, alone_splits) = one.install(decode);
            let (split, splits) = two.install(decode);
            assert_eq!(alone_splits, 0, "{family}: one thread never splits heads");
            assert!(
                splits >= 3,
                "{family}, {seqs} sequences: heads split {splits} times"
            );
            assert_eq!(alone.len(), 3 * seqs as usize);
            assert!(alone.iter().flatten().all(|v| v.is_finite()));
            assert_eq!(
                alone, split,
                "{family}, {seqs} sequences: long sequences' bits changed when split"
            );
        }
    }
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    let sharded = dir.path().join("sharded");
    synth(&single, Family::Mixtral, None);
    rewrite(&single, &sharded, 3, |_, _, _, _| true);
    assert!(sharded.join("model-00003-of-00003.safetensors").exists());
    assert_eq!(logits(&single, &prompts()), logits(&sharded, &prompts()));
}

/// The MXFP4 checkpoint and an f32 checkpoint holding its exactly dequantized experts (in the
/// `[E, in, out]` layout transformers saves) must give identical logits.
#[test]
fn mxfp4_equals_its_dequantized_twin() {
    let dir = tempfile::tempdir().unwrap();
    let packed = dir.path().join("mxfp4");
    let plain = dir.path().join("f32");
    synth(&packed, Family::GptOss, Some(SynthFormat::Mxfp4));
    let ck = Checkpoint::open(&packed).unwrap();
    rewrite(&packed, &plain, 1, |name, dtype, shape, bytes| {
        if name.ends_with("_scales") {
            return false;
        }
        let Some(base) = name.strip_suffix("_blocks") else {
            return true;
        };
        let scales = ck.get(&format!("{base}_scales")).unwrap();
        let (e, out, groups) = (shape[0], shape[1], shape[2]);
        let inp = groups * 32;
        let m = model::WeightMatrix::mxfp4(
            e * out,
            inp,
            model::checkpoint::SharedBytes::from_vec(bytes.clone()),
            scales.bytes.clone(),
        );
        let values = m.to_f32();
        // [E, out, in] -> [E, in, out], as transformers saves unquantized GPT-OSS experts.
        let mut t = vec![0f32; values.len()];
        for x in 0..e {
            for o in 0..out {
                for i in 0..inp {
                    t[x * inp * out + i * out + o] = values[x * out * inp + o * inp + i];
                }
            }
        }
        *dtype = "F32";
        *shape = vec![e, inp, out];
        *name = base.to_owned();
        *bytes = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        true
    });
    let text = std::fs::read_to_string(plain.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config");
    std::fs::write(plain.join("config.json"), config.to_string()).unwrap();
    assert_eq!(logits(&packed, &prompts()), logits(&plain, &prompts()));
}

fn load_error(dir: &Path) -> String {
    ModelWeights::load(dir).unwrap_err().to_string()
}

#[test]
fn broken_checkpoints_give_clear_errors() {
    let root = tempfile::tempdir().unwrap();
    let good = root.path().join("good");
    synth(&good, Family::GptOss, None);

    // Truncated file.
    let truncated = root.path().join("truncated");
    rewrite(&good, &truncated, 1, |_, _, _, _| true);
    let file = truncated.join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = load_error(&truncated);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );

    // Garbage header.
    let corrupt = root.path().join("corrupt");
    rewrite(&good, &corrupt, 1, |_, _, _, _| true);
    let file = corrupt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..20].copy_from_slice(b"not json at!");
    std::fs::write(&file, bytes).unwrap();
    let err = load_error(&corrupt);
    assert!(
        err.contains("model.safetensors") && err.contains("corrupt"),
        "{err}"
    );

    // A missing tensor.
    let missing = root.path().join("missing");
    rewrite(&good, &missing, 1, |name, _, _, _| {
        name.as_str() != "model.layers.1.self_attn.sinks"
    });
    let err = load_error(&missing);
    assert!(
        err.contains("model.layers.1.self_attn.sinks") && err.contains("missing"),
        "{err}"
    );

    // A misshapen tensor.
    let misshapen = root.path().join("misshapen");
    rewrite(&good, &misshapen, 1, |name, _, shape, bytes| {
        if name == "model.norm.weight" {
            shape[0] -= 1;
            bytes.truncate(bytes.len() - 2);
        }
        true
    });
    let err = load_error(&misshapen);
    assert!(
        err.contains("model.norm.weight") && err.contains("shape"),
        "{err}"
    );

    // An unsupported dtype.
    let int = root.path().join("int");
    rewrite(&good, &int, 1, |name, dtype, shape, bytes| {
        if name == "model.layers.0.self_attn.q_proj.weight" {
            *dtype = "U8";
            bytes.truncate(shape.iter().product());
        }
        true
    });
    let err = load_error(&int);
    assert!(
        err.contains("q_proj.weight") && err.contains("dtype"),
        "{err}"
    );

    // No weights at all, and no config.
    let empty = root.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(good.join("config.json"), empty.join("config.json")).unwrap();
    let err = load_error(&empty);
    assert!(err.contains("no weights"), "{err}");
    let err = load_error(&root.path().join("nowhere"));
    assert!(err.contains("config.json"), "{err}");

    // A shard index naming a file that is not there.
    let lost = root.path().join("lost-shard");
    rewrite(&good, &lost, 2, |_, _, _, _| true);
    std::fs::remove_file(lost.join("model-00002-of-00002.safetensors")).unwrap();
    let err = load_error(&lost);
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
}

/// Matrices moved into huge pages compute the same bits as where they lie in the file, in
/// every family and stored format (MXFP4's fused experts share one copy of their tensor).
#[test]
fn weights_in_huge_pages_give_the_same_logits() {
    use model::weights::HugePages;
    for (family, format) in [
        (Family::Mixtral, None),
        (Family::GptOss, Some(SynthFormat::Mxfp4)),
        (Family::Qwen3Moe, None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        synth(dir.path(), family, format);
        let run = |huge_pages| {
            let mut weights = ModelWeights::load(dir.path()).unwrap();
            let moved = weights.move_to_huge_pages(huge_pages).unwrap();
            assert_eq!(
                moved > 0,
                huge_pages != HugePages::Off,
                "{family:?} {huge_pages:?}"
            );
            // Moving again finds nothing left in the file.
            assert_eq!(weights.move_to_huge_pages(huge_pages).unwrap(), 0);
            let mut m = ReferenceModel::new(weights).unwrap();
            let chunks = vec![SeqChunk {
                seq: 0,
                tokens: PROMPTS[0].to_vec(),
            }];
            m.forward(&chunks, LogitsFor::AllTokens).unwrap()
        };
        let mapped = run(HugePages::Off);
        for which in [HugePages::Layers, HugePages::LayersAndLmHead] {
            let moved = run(which);
            let bits = |l: &Vec<Vec<f32>>| -> Vec<u32> {
                l.iter().flatten().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&mapped), bits(&moved), "{family:?} {which:?}");
        }
    }
}
