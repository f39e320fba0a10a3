//! The hot kernel alone: one 32-row tile of GPT-OSS-20B's expert width (2880), MXFP4 and bf16,
//! at 1, 4 and 32 tokens (decode, an expert's share of a decode batch, a prompt chunk), AVX-512
//! and portable paths (throughput in weight bytes), segments folded as the executor does for
//! such a tile.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

use corsair_ffn::Span;
use corsair_ffn::executor::kernel::{
    KernelChoice, PartialsLayout, TileInput, TileView, pack_rows, pair_order, tile_partials,
};
use corsair_ffn::format::{TileFormat, encode_row};
use corsair_ffn::numerics::padded;
use corsair_ffn::synthetic::{SplitMix, random_matrix};
use model::weights::WeightFormat;

const ROWS: usize = 32;
const COLS: usize = 2880;
/// The tile spans the whole reduction, so the executor folds its segments as they come.
const FOLDED: PartialsLayout = PartialsLayout::Folded;

fn kernel(c: &mut Criterion) {
    let mut group = c.benchmark_group("tile_partials");
    for (stored, format) in [
        (WeightFormat::Mxfp4, TileFormat::Mxfp4),
        (WeightFormat::Bf16, TileFormat::Bf16),
    ] {
        let mut rng = SplitMix::new(1, 2);
        let m = random_matrix(ROWS, COLS, stored, 0.1, &mut rng);
        let mut bytes = vec![0u8; ROWS * format.row_bytes(COLS)];
        let span = Span::new(0, COLS);
        let encode = |r, d: &mut [u8], s: &mut [u8]| encode_row(&m, r, span, format, 0, COLS, d, s);
        pack_rows(format, ROWS, COLS, encode, &mut bytes);
        let view = TileView::new(format, ROWS, COLS, &bytes);
        let kp = padded(COLS);
        for tokens in [1usize, 4, 32] {
            let mut x = vec![0f32; tokens * kp];
            let mut xb = vec![0u16; tokens * kp];
            for t in 0..tokens {
                let row: Vec<f32> = (0..COLS).map(|_| rng.symmetric()).collect();
                pair_order(&row, &mut x[t * kp..(t + 1) * kp]);
                for (d, &v) in xb[t * kp..].iter_mut().zip(&row) {
                    *d = model::kernels::round_bf16(v);
                }
            }
            let mut out = vec![0f32; tokens * ROWS * view.segments()];
            group.throughput(Throughput::Bytes(bytes.len() as u64));
            for kernel in KernelChoice::ALL {
                let id = BenchmarkId::new(format!("{format}/{kernel:?}"), tokens);
                group.bench_with_input(id, &tokens, |b, &tokens| {
                    let x = TileInput::Paired(&x);
                    b.iter(|| tile_partials(&view, x, kp, tokens, &mut out, FOLDED, kernel))
                });
            }
            if matches!(format, TileFormat::Bf16 | TileFormat::Mxfp4) {
                // The bf16 activation path, beside the f32 one above.
                let id = BenchmarkId::new(format!("{format}/bf16-activations"), tokens);
                group.bench_with_input(id, &tokens, |b, &tokens| {
                    let x = TileInput::Bf16(&xb);
                    b.iter(|| {
                        tile_partials(&view, x, kp, tokens, &mut out, FOLDED, KernelChoice::Auto)
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, kernel);
criterion_main!(benches);
