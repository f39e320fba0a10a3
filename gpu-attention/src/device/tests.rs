//! The custom ops' CPU implementations (paged attention's is its kernel's twin; the linear
//! ops' are plain dot products) against plain references:
//! paged attention against the reference's matmul attention over a contiguous history, the
//! linear ops against an f32 matmul of the decoded weights.

use candle_core::{DType, Device, Tensor};
use model::WeightMatrix;
use model::config::AttentionKind;
use model::forward::attention::attention_core;
use model::weights::Linear;

use super::linear::DeviceLinear;
use super::paged::{CHUNK, PagedAttention};

/// Deterministic pseudo-random values in [-1, 1) (the twins' tests use them too).
pub(super) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Several sequences' last queries against scattered blocks of a shared pool: the op equals the
/// matmul attention over each sequence's contiguous history, for full and sliding attention,
/// with and without sinks, GQA groups of 1, 2 and 4, and histories longer than one chunk.
#[test]
fn paged_attention_equals_attention_over_the_gathered_history() {
    let dev = Device::Cpu;
    let block_size = 4;
    for (heads, kv_heads, d) in [(4, 2, 16), (4, 1, 12), (2, 2, 8), (8, 2, 64)] {
        for kind in [
            AttentionKind::Full,
            AttentionKind::Sliding { window: 5 },
            AttentionKind::Sliding { window: 200 },
        ] {
            for with_sinks in [false, true] {
                // (past, new queries) per sequence; 300 keys span three chunks.
                let seqs = [(0usize, 1usize), (6, 2), (2 * CHUNK + 43, 1), (9, 3)];
                let num_blocks = 128;
                let kv_w = kv_heads * d;
                let mut k_pool = vec![0f32; num_blocks * block_size * kv_w];
                let mut v_pool = k_pool.clone();
                let mut next_block = num_blocks;
                let mut tables = Vec::new();
                let mut histories = Vec::new();
                for (s, &(past, t)) in seqs.iter().enumerate() {
                    let total = past + t;
                    // Blocks handed out from the top down: never in order.
                    let blocks: Vec<u32> = (0..total.div_ceil(block_size))
                        .map(|_| {
                            next_block -= 1;
                            next_block as u32
                        })
                        .collect();
                    let keys = values(total * kv_w, 10 + s as u64);
                    let vals = values(total * kv_w, 20 + s as u64);
                    for p in 0..total {
                        let slot = blocks[p / block_size] as usize * block_size + p % block_size;
                        k_pool[slot * kv_w..(slot + 1) * kv_w]
                            .copy_from_slice(&keys[p * kv_w..(p + 1) * kv_w]);
                        v_pool[slot * kv_w..(slot + 1) * kv_w]
                            .copy_from_slice(&vals[p * kv_w..(p + 1) * kv_w]);
                    }
                    tables.push(blocks);
                    histories.push((keys, vals));
                }
                let max_blocks = tables.iter().map(Vec::len).max().unwrap();
                let mut flat_tables = Vec::new();
                for t in &tables {
                    flat_tables.extend(t);
                    flat_tables.extend(std::iter::repeat_n(0, max_blocks - t.len()));
                }
                let mut rows = Vec::new();
                for (s, &(past, t)) in seqs.iter().enumerate() {
                    for p in past..past + t {
                        rows.extend([s as u32, p as u32]);
                    }
                }
                let n = rows.len() / 2;
                let q = values(n * heads * d, 99);
                let sinks = values(heads, 98);
                let sink_t = Tensor::from_slice(&sinks, heads, &dev).unwrap();
                let op = PagedAttention {
                    heads,
                    kv_heads,
                    head_dim: d,
                    block_size,
                    scale: (d as f32).powf(-0.5),
                    window: match kind {
                        AttentionKind::Full => None,
                        AttentionKind::Sliding { window } => Some(window),
                    },
                    sinks: with_sinks.then(|| sink_t.clone()),
                    tables: Tensor::from_vec(flat_tables, (tables.len(), max_blocks), &dev)
                        .unwrap(),
                    rows: Tensor::from_vec(rows, (n, 2), &dev).unwrap(),
                };
                let pool = |v: &[f32]| {
                    Tensor::from_slice(v, (num_blocks * block_size, kv_heads, d), &dev).unwrap()
                };
                let qt = Tensor::from_slice(&q, (n, heads, d), &dev).unwrap();
                let got = host(
                    &qt.apply_op3_no_bwd(&pool(&k_pool), &pool(&v_pool), &op)
                        .unwrap(),
                );
                let mut row = 0;
                for (s, &(past, t)) in seqs.iter().enumerate() {
                    let total = past + t;
                    let (keys, vals) = &histories[s];
                    let hist = |x: &[f32]| {
                        Tensor::from_slice(x, (total, kv_heads, d), &dev)
                            .unwrap()
                            .transpose(0, 1)
                            .unwrap()
                            .contiguous()
                            .unwrap()
                    };
                    let qs = Tensor::from_slice(
                        &q[row * heads * d..(row + t) * heads * d],
                        (t, heads, d),
                        &dev,
                    )
                    .unwrap()
                    .transpose(0, 1)
                    .unwrap()
                    .contiguous()
                    .unwrap();
                    let want = host(
                        &attention_core(
                            &qs,
                            &hist(keys),
                            &hist(vals),
                            past,
                            kind,
                            with_sinks.then_some(&sink_t),
                            (d as f64).powf(-0.5),
                        )
                        .unwrap(),
                    );
                    let worst = max_diff(&got[row * heads * d..(row + t) * heads * d], &want);
                    assert!(
                        worst < 1e-5,
                        "{heads}/{kv_heads}x{d} {kind:?} sinks={with_sinks} seq {s}: {worst}"
                    );
                    row += t;
                }
            }
        }
    }
}

#[test]
fn paged_attention_refuses_inconsistent_shapes() {
    let dev = Device::Cpu;
    let op = PagedAttention {
        heads: 4,
        kv_heads: 3,
        head_dim: 8,
        block_size: 4,
        scale: 1.0,
        window: None,
        sinks: None,
        tables: Tensor::zeros((1, 1), DType::U32, &dev).unwrap(),
        rows: Tensor::zeros((1, 2), DType::U32, &dev).unwrap(),
    };
    let q = Tensor::zeros((1, 4, 8), DType::F32, &dev).unwrap();
    let pool = Tensor::zeros((8, 3, 8), DType::F32, &dev).unwrap();
    let err = q
        .apply_op3_no_bwd(&pool, &pool, &op)
        .unwrap_err()
        .to_string();
    assert!(err.contains("kv heads"), "{err}");
}

/// A linear layer of `format` against the f32 matmul of its decoded weights, for decode-sized
/// token counts (the custom op) and prefill-sized ones (the matmul path).
#[test]
fn device_linear_layers_equal_the_decoded_matmul_in_every_format() {
    let dev = Device::Cpu;
    let (rows, cols) = (24, 64);
    let w = values(rows * cols, 5);
    let bias = values(rows, 6);
    let bf16: Vec<u8> = w
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let f16: Vec<u8> = w
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    let shared = |b: Vec<u8>| model::checkpoint::SharedBytes::from_vec(b);
    let blocks: Vec<u8> = values(rows * cols / 2, 7)
        .iter()
        .map(|&v| ((v + 1.0) * 127.9) as u8)
        .collect();
    let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i % 5) as u8).collect();
    let matrices = [
        WeightMatrix::from_f32(rows, cols, &w),
        WeightMatrix::from_bytes(model::WeightFormat::Bf16, rows, cols, shared(bf16)),
        WeightMatrix::from_bytes(model::WeightFormat::F16, rows, cols, shared(f16)),
        WeightMatrix::mxfp4(rows, cols, shared(blocks), shared(scales)),
        // A strided row selection (how fused checkpoints hand out q, k and v).
        WeightMatrix::from_f32(rows * 2, cols, &values(rows * 2 * cols, 8)).select_rows(1, 2, rows),
    ];
    for matrix in matrices {
        let decoded = matrix.to_f32();
        let linear = Linear {
            weight: matrix.clone(),
            bias: Some(bias.clone()),
        };
        let device = DeviceLinear::upload(&linear, &dev).unwrap();
        for tokens in [1, 3, 8, 9, 40] {
            let x = values(tokens * cols, 11 + tokens as u64);
            let got = host(
                &device
                    .forward(&Tensor::from_slice(&x, (tokens, cols), &dev).unwrap())
                    .unwrap(),
            );
            let mut want = vec![0f32; tokens * rows];
            for t in 0..tokens {
                for r in 0..rows {
                    let dot: f64 = (0..cols)
                        .map(|k| x[t * cols + k] as f64 * decoded[r * cols + k] as f64)
                        .sum();
                    want[t * rows + r] = dot as f32 + bias[r];
                }
            }
            let worst = max_diff(&got, &want);
            assert!(
                worst < 1e-4,
                "{} x {tokens} tokens: {worst}",
                matrix.format()
            );
        }
    }
}

/// Window 0 means "no window" in the CPU twin as in the kernel (it once gave NaN there).
#[test]
fn paged_attention_reads_window_zero_as_no_window() {
    let dev = Device::Cpu;
    let (heads, d, block_size, keys) = (2, 8, 4, 11);
    let run = |window: Option<usize>| {
        let op = PagedAttention {
            heads,
            kv_heads: 1,
            head_dim: d,
            block_size,
            scale: 0.3,
            window,
            sinks: None,
            tables: Tensor::from_vec(vec![2u32, 0, 1], (1, 3), &dev).unwrap(),
            rows: Tensor::from_vec(vec![0u32, keys as u32 - 1], (1, 2), &dev).unwrap(),
        };
        let pool = |seed| {
            Tensor::from_vec(
                values(3 * block_size * d, seed),
                (3 * block_size, 1, d),
                &dev,
            )
            .unwrap()
        };
        let q = Tensor::from_vec(values(heads * d, 3), (1, heads, d), &dev).unwrap();
        host(&q.apply_op3_no_bwd(&pool(1), &pool(2), &op).unwrap())
    };
    let all = run(None);
    assert!(all.iter().all(|v| v.is_finite()));
    assert_eq!(run(Some(0)), all);
    assert_ne!(run(Some(3)), all, "a window of 3 sees fewer keys");
}

/// The paged kernel reads every block its table names without checking: the inputs refuse a
/// table naming a block past the cache, or too short for its positions, before any upload.
#[test]
fn micro_batch_inputs_refuse_block_tables_the_kernel_cannot_trust() {
    use super::inputs::{MbInputs, SpanInput};
    let capacity = step::KvCapacity {
        block_size: 4,
        num_blocks: 8,
    };
    let rope = model::forward::rope::RopeTables {
        cos: vec![1.0; 4],
        sin: vec![0.0; 4],
    };
    let build = |table: &[u32], past: usize| {
        let spans = [SpanInput {
            tokens: &[5],
            past,
            table,
        }];
        MbInputs::new(&spans, &rope, capacity, 8, &Device::Cpu)
    };
    assert!(build(&[3, 7, 0], 9).is_ok());
    // Block 9 holds positions 0..4: only the paged kernel would read it.
    let err = build(&[9, 7, 0], 9).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("block 9, past the cache's 8 blocks"), "{err}");
    let err = build(&[3, 7], 9).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("outside its block table"), "{err}");
}
