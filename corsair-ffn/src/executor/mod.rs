//! The executor: runs a program's instructions on the CPU with real numerics, on a thread pool.
//!
//! Weights are read from the bound memories ([`crate::weights::BoundMemory`]) in their stored
//! format; transient buffers live in one arena at their pool addresses, so buffers the memory
//! plan overlaps share storage here too. Tiles of a matmul run
//! in parallel, each writing its own partials; reductions, activations and sums follow the
//! numerics definition ([`crate::numerics`]), so results do not depend on the thread count.

mod arena;
pub mod kernel;

use rayon::prelude::*;

use crate::assignment::Span;
use crate::error::{Error, Result};
use crate::host_cpus::{pin_to_mask, run_as_batch_work};
use crate::lm_head::{CandidateOptions, LmProposal, RowSampling, propose};
use crate::numerics::padded;
use crate::program::{Matrix, Op, OutLayout, Program, RegionId, RowCount, Tile};
use crate::weights::BoundMemory;
use arena::{Arena, f32s, f32s_mut};
pub use kernel::KernelChoice;
use kernel::{PartialsLayout, TileInput, TileView, pair_order, tile_partials};
use model::kernels::{ActivationDtype, Mxint8Input, round_bf16};

/// One routing slot of a token: a local expert and its weight, or [`Slot::EMPTY`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    /// Global expert id (`u32::MAX`: unused).
    pub expert: u32,
    /// Routing weight.
    pub weight: f32,
}

impl Slot {
    /// An unused slot.
    pub const EMPTY: Slot = Slot {
        expert: u32::MAX,
        weight: 0.0,
    };
}

/// How the executor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExecOptions {
    /// Worker threads; 0 uses every core.
    pub threads: usize,
    /// Kernel implementation.
    pub kernel: KernelChoice,
    /// CPUs the worker threads may run on, as a bit mask (bit `i` = CPU `i`); 0 leaves them
    /// to the OS. Pinning cards and the attention node to separate CPUs makes them behave like
    /// separate devices on a small host (each thread is pinned to one CPU of the mask, in turn).
    pub cpu_mask: u64,
}

/// What one call needs besides the program.
pub(crate) struct Call<'a> {
    pub tokens: usize,
    pub x: &'a [f32],
    pub slots: Option<&'a [Slot]>,
    pub sampling: &'a [RowSampling],
    pub candidates: CandidateOptions,
}

/// What one call produced.
#[derive(Debug, Default)]
pub(crate) struct Produced {
    /// Rows sent back (layers).
    pub sent: Vec<f32>,
    /// Proposals (LM head).
    pub proposals: Vec<LmProposal>,
    /// Rows routed to each local expert.
    pub expert_rows: Vec<usize>,
}

/// A program with its weights bound, ready to run.
pub(crate) struct Executor {
    pub program: Program,
    memory: BoundMemory,
    arena: Arena,
    /// The executor's threads; `None` with one thread: a call then runs on the caller's thread
    /// alone, with no idle pool thread spinning between calls on a core others need.
    pool: Option<std::sync::Arc<rayon::ThreadPool>>,
    kernel: KernelChoice,
    /// Pair-ordered inputs of the current matmul (reused).
    xp: Vec<f32>,
    /// Inputs of the current matmul rounded to bf16 (reused; bf16 matrices).
    xb: Vec<u16>,
    /// Inputs of the current matmul quantized to MXINT8 (reused; MXINT8-order matrices).
    xq: Mxint8Input,
}

impl Executor {
    pub fn new(program: Program, memory: BoundMemory, options: ExecOptions) -> Result<Self> {
        let mask = options.cpu_mask;
        let pool = if options.threads == 1 {
            None
        } else {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(options.threads)
                .thread_name(|i| format!("corsair-exec-{i}"))
                .start_handler(move |i| {
                    run_as_batch_work();
                    pin_to_mask(mask, i)
                })
                .build()
                .map_err(Error::ExecutorThreads)?;
            Some(std::sync::Arc::new(pool))
        };
        Ok(Executor {
            arena: Arena::new(&program),
            program,
            memory,
            pool,
            kernel: options.kernel,
            xp: Vec::new(),
            xb: Vec::new(),
            xq: Mxint8Input::default(),
        })
    }

    fn words(&self, id: RegionId, offset: usize, len: usize) -> Result<arena::Words> {
        Arena::range(&self.program, id, offset, len)
    }

    /// Bytes of a resident region (SRAM or LPDDR).
    fn resident(&self, id: RegionId) -> Result<&[u8]> {
        self.memory
            .region(&self.program, id)
            .ok_or_else(|| Error::Weights(format!("{} is not bound", self.program.region(id).name)))
    }

    /// Runs the instructions of `span` for one call, on the executor's pool (the whole call,
    /// so the parallel steps inside it start without waking threads from another pool), or on
    /// this thread when the executor has one thread.
    pub fn run(&mut self, span: Span, call: &Call<'_>) -> Result<Produced> {
        match self.pool.clone() {
            Some(pool) => pool.install(|| self.run_here(span, call)),
            None => self.run_here(span, call),
        }
    }

    fn run_here(&mut self, span: Span, call: &Call<'_>) -> Result<Produced> {
        let mut out = Produced::default();
        let n = call.tokens;
        for i in span.start..span.end {
            let rows_of = |r: RowCount, produced: &Produced| match r {
                RowCount::Tokens => n,
                RowCount::Expert(e) => produced.expert_rows.get(e as usize).copied().unwrap_or(0),
            };
            // Each arm copies out the instruction's few scalar fields; what holds a list
            // (matmul tiles, the slots' experts) is read in place by index, so no instruction
            // is cloned per call.
            match self.program.instructions[i] {
                Op::Receive { x, slots } => self.receive(x, slots, call)?,
                Op::Gather {
                    local,
                    expert,
                    slots,
                    x,
                    rows,
                    map,
                } => {
                    let count = self.gather(expert, slots, x, rows, map, call)?;
                    let local = local as usize;
                    if out.expert_rows.len() <= local {
                        out.expert_rows.resize(local + 1, 0);
                    }
                    out.expert_rows[local] = count;
                }
                Op::Stream { .. } => {
                    // Streamed tiles are read in place from their LPDDR region by the matmul
                    // that follows (see `matmul`): on this CPU the staging copy would only
                    // triple the memory traffic. The performance model still charges it.
                }
                Op::MatMul { rows, .. } => {
                    let r = rows_of(rows, &out);
                    if r > 0 {
                        self.matmul(i, r)?;
                    }
                }
                Op::Reduce {
                    matmul,
                    out: dst,
                    layout,
                } => {
                    let Some(Op::MatMul { rows, .. }) =
                        self.program.instructions.get(matmul as usize)
                    else {
                        return Err(Error::Request(format!(
                            "instruction {i} reduces a non-matmul"
                        )));
                    };
                    let r = rows_of(*rows, &out);
                    if r > 0 {
                        self.reduce(matmul as usize, dst, layout, r)?;
                    }
                }
                Op::Activate {
                    rows,
                    gate_up,
                    out: dst,
                    width,
                    activation,
                } => {
                    let r = rows_of(rows, &out);
                    let w = width as usize;
                    let (src, d) = (
                        self.words(gate_up, 0, r * 2 * w)?,
                        self.words(dst, 0, r * w)?,
                    );
                    let ([src], [d]) = self.arena.split([src], [d])?;
                    let act = activation.into();
                    let (src, d) = (f32s(src), f32s_mut(d));
                    let apply = |(d, s): (&mut [f32], &[f32])| {
                        for (i, o) in d.iter_mut().enumerate() {
                            *o = model::kernels::activate(act, s[i], s[w + i]);
                        }
                    };
                    match &self.pool {
                        Some(pool) => pool.install(|| {
                            d.par_chunks_mut(w.max(1))
                                .zip(src.par_chunks(2 * w.max(1)))
                                .for_each(apply)
                        }),
                        None => d
                            .chunks_mut(w.max(1))
                            .zip(src.chunks(2 * w.max(1)))
                            .for_each(apply),
                    }
                }
                Op::Scale { rows, values, map } => {
                    let r = rows_of(rows, &out);
                    let h = self.program.hidden;
                    let (m, v) = (self.words(map, 0, 2 * r)?, self.words(values, 0, r * h)?);
                    let ([m], [v]) = self.arena.split([m], [v])?;
                    for (row, vals) in f32s_mut(v).chunks_exact_mut(h).enumerate() {
                        let w = f32::from_bits(m[2 * row + 1]);
                        for x in vals {
                            *x *= w;
                        }
                    }
                }
                Op::SumSlots {
                    slots, out: dst, ..
                } => self.sum_slots(i, slots, dst, call)?,
                Op::Fill { region } => {
                    let len = (self.program.region(region).bytes / 4) as usize;
                    let w = self.words(region, 0, len)?;
                    let ([], [d]) = self.arena.split([], [w])?;
                    d.fill(0);
                }
                Op::Send { src } => {
                    if self
                        .program
                        .lm_head
                        .as_ref()
                        .is_none_or(|l| !(l.instructions.start..l.instructions.end).contains(&i))
                    {
                        let w = self.words(src, 0, n * self.program.hidden)?;
                        out.sent = f32s(self.arena.get(w)?).to_vec();
                    }
                }
                Op::Propose { logits, out: dst } => {
                    out.proposals = self.propose(logits, dst, call)?
                }
            }
        }
        Ok(out)
    }

    fn receive(&mut self, x: RegionId, slots: Option<RegionId>, call: &Call<'_>) -> Result<()> {
        let n = call.tokens;
        let h = self.program.hidden;
        let xw = self.words(x, 0, n * h)?;
        let ([], [d]) = self.arena.split([], [xw])?;
        f32s_mut(d).copy_from_slice(call.x);
        if let (Some(s), Some(given)) = (slots, call.slots) {
            let sw = self.words(s, 0, 2 * given.len())?;
            let ([], [d]) = self.arena.split([], [sw])?;
            for (pair, slot) in d.chunks_exact_mut(2).zip(given) {
                pair[0] = slot.expert;
                pair[1] = slot.weight.to_bits();
            }
        }
        Ok(())
    }

    fn gather(
        &mut self,
        expert: u32,
        slots: RegionId,
        x: RegionId,
        rows: RegionId,
        map: RegionId,
        call: &Call<'_>,
    ) -> Result<usize> {
        let (n, h, k) = (call.tokens, self.program.hidden, self.program.top_k);
        let count = call
            .slots
            .map_or(0, |s| s.iter().filter(|s| s.expert == expert).count());
        let ranges = (
            self.words(slots, 0, 2 * n * k)?,
            self.words(x, 0, n * h)?,
            self.words(rows, 0, count * h)?,
            self.words(map, 0, 2 * count)?,
        );
        let ([s, xs], [dst, mp]) = self
            .arena
            .split([ranges.0, ranges.1], [ranges.2, ranges.3])?;
        let (xs, dst) = (f32s(xs), f32s_mut(dst));
        let mut r = 0;
        for t in 0..n {
            for j in 0..k {
                let e = s[2 * (t * k + j)];
                if e == expert {
                    dst[r * h..(r + 1) * h].copy_from_slice(&xs[t * h..(t + 1) * h]);
                    mp[2 * r] = t as u32;
                    mp[2 * r + 1] = s[2 * (t * k + j) + 1];
                    r += 1;
                }
            }
        }
        Ok(count)
    }

    fn matmul(&mut self, i: usize, r: usize) -> Result<()> {
        let Op::MatMul {
            matrix,
            input,
            partials,
            tiles,
            ..
        } = &self.program.instructions[i]
        else {
            return Err(Error::Request(format!("instruction {i} is not a matmul")));
        };
        let m = &self.program.matrices[*matrix as usize];
        let (k, kp) = (m.cols, padded(m.cols));
        // Pair-ordered inputs, one row per token.
        let xw = Arena::range(&self.program, *input, 0, r * k)?;
        let x = f32s(self.arena.get(xw)?);
        let numerics = m.activations;
        if numerics == ActivationDtype::Mxint8 {
            // Quantized once for every tile of the matrix (tiles start at segment boundaries).
            self.xq.quantize(x, r, k, m.format.block_format());
        } else if numerics == ActivationDtype::Bf16 {
            // Rounded once, zero-padded to whole blocks.
            self.xb.clear();
            self.xb.resize(r * kp, 0);
            for (src, dst) in x.chunks_exact(k).zip(self.xb.chunks_exact_mut(kp)) {
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = round_bf16(v);
                }
            }
        } else {
            self.xp.resize(r * kp, 0.0);
            for (src, dst) in x.chunks_exact(k).zip(self.xp.chunks_exact_mut(kp)) {
                pair_order(src, dst);
            }
        }
        // Each tile's weights (resident, or streamed into a staging buffer) and its partials,
        // packed for this call's tokens (see `packed_partials`).
        let total = (self.program.region(*partials).bytes / 4) as usize;
        let pw = Arena::range(&self.program, *partials, 0, total)?;
        let ([], [part]) = self.arena.split([], [pw])?;
        let mut jobs = Vec::with_capacity(tiles.len());
        let mut rest = f32s_mut(part);
        for run in tiles {
            let t = &m.tiles[run.tile as usize];
            let cols = m.columns(t.segments);
            // Resident or streamed, a tile is read in place from its own region: a streamed
            // one's region holds exactly what `Stream` would have staged.
            let view = self
                .memory
                .tile(&self.program, t.region)
                .and_then(|(data, scales)| {
                    TileView::from_parts(m.format, t.rows.len(), cols.len(), data, scales)
                })
                .ok_or_else(|| {
                    Error::Weights(format!("{}: tile {} is not bound", m.name, run.tile))
                })?;
            let len = packed_partials(m, t, r);
            if len > rest.len() {
                return Err(Error::Request(format!(
                    "{}: the tiles' partials need more than their region's {total} floats",
                    m.name
                )));
            }
            let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            let layout = partials_layout(m, t);
            jobs.push((view, cols.start, chunk, layout));
        }
        let input = match numerics {
            ActivationDtype::Mxint8 => TileInput::Mxint8 {
                input: &self.xq,
                from_block: 0,
            },
            ActivationDtype::Bf16 => TileInput::Bf16(&self.xb),
            ActivationDtype::F32 => TileInput::Paired(&self.xp),
        };
        let kernel = self.kernel;
        let job = |(view, c0, chunk, layout): (TileView<'_>, usize, &mut [f32], PartialsLayout)| {
            tile_partials(&view, input.skip(c0), kp, r, chunk, layout, kernel)
        };
        match &self.pool {
            Some(pool) => pool.install(|| jobs.into_par_iter().for_each(job)),
            None => jobs.into_iter().for_each(job),
        }
        Ok(())
    }

    fn reduce(&mut self, matmul: usize, dst: RegionId, layout: OutLayout, r: usize) -> Result<()> {
        let Op::MatMul {
            matrix,
            partials,
            tiles,
            ..
        } = &self.program.instructions[matmul]
        else {
            return Err(Error::Request(format!(
                "instruction {matmul} is not a matmul"
            )));
        };
        let m = &self.program.matrices[*matrix as usize];
        let bias: Option<Vec<f32>> = match m.bias {
            Some(b) => Some(
                self.resident(b)?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            None => None,
        };
        let total = (self.program.region(*partials).bytes / 4) as usize;
        let pw = Arena::range(&self.program, *partials, 0, total)?;
        let out_len = (self.program.region(dst).bytes / 4) as usize;
        let ow = Arena::range(&self.program, dst, 0, out_len)?;
        let ([part], [out]) = self.arena.split([pw], [ow])?;
        let (part, out) = (f32s(part), f32s_mut(out));
        // Tiles are emitted row band by row band, segments ascending within a band. A row's
        // partials add in that order (the first one assigned), then its bias.
        let mut acc: Vec<f32> = Vec::new();
        // Where the band's first tile's partials start: `matmul` packs them tile by tile.
        let mut band_first = 0;
        let mut k = 0;
        while k < tiles.len() {
            let band = m.tiles[tiles[k].tile as usize].rows;
            let mut end = k;
            while end < tiles.len() && m.tiles[tiles[end].tile as usize].rows == band {
                end += 1;
            }
            // `acc` is `[token][row of the band]`, each token's rows padded by 16 floats so that
            // reading one row across tokens does not land every token in one cache set.
            let stride = band.len() + 16;
            acc.clear();
            acc.resize(r * stride, 0.0);
            let mut band_end = band_first;
            for (t, acc) in acc.chunks_exact_mut(stride).enumerate() {
                let acc = &mut acc[..band.len()];
                let mut first = band_first;
                for (i, run) in tiles[k..end].iter().enumerate() {
                    let tile = &m.tiles[run.tile as usize];
                    let ns = partials_layout(m, tile).per_row(tile.segments.len());
                    let base = first + t * band.len() * ns;
                    first += packed_partials(m, tile, r);
                    let block = part.get(base..base + band.len() * ns).ok_or_else(|| {
                        Error::Request(format!(
                            "{}: the tiles' partials need more than their region's {} floats",
                            m.name,
                            part.len()
                        ))
                    })?;
                    if ns == 1 && i == 0 {
                        acc.copy_from_slice(block);
                    } else if ns == 1 {
                        acc.iter_mut().zip(block).for_each(|(y, q)| *y += q);
                    } else {
                        // Summed in a register, in segment order: the same additions as
                        // `*y += q` per segment, without a store and reload per term.
                        for (y, segs) in acc.iter_mut().zip(block.chunks_exact(ns)) {
                            let mut v = if i == 0 { segs[0] } else { *y + segs[0] };
                            for &q in &segs[1..] {
                                v += q;
                            }
                            *y = v;
                        }
                    }
                }
                if let Some(b) = &bias {
                    acc.iter_mut()
                        .zip(&b[band.start..band.end])
                        .for_each(|(y, b)| *y += b);
                }
                band_end = first;
            }
            match layout {
                OutLayout::TokenMajor => {
                    for (t, acc) in acc.chunks_exact(stride).enumerate() {
                        out[t * m.rows + band.start..t * m.rows + band.end]
                            .copy_from_slice(&acc[..band.len()]);
                    }
                }
                // Row by row, so the writes run along `out` and the reads stay in a few lines.
                OutLayout::RowMajor => {
                    for (i, row) in (band.start..band.end).enumerate() {
                        for (t, o) in out[row * r..(row + 1) * r].iter_mut().enumerate() {
                            *o = acc[t * stride + i];
                        }
                    }
                }
            }
            band_first = band_end;
            k = end;
        }
        Ok(())
    }

    /// Instruction `i`, a [`Op::SumSlots`] over `slots` into `dst`.
    fn sum_slots(
        &mut self,
        i: usize,
        slots: RegionId,
        dst: RegionId,
        call: &Call<'_>,
    ) -> Result<()> {
        let Op::SumSlots { experts, .. } = &self.program.instructions[i] else {
            return Err(Error::Request(format!("instruction {i} is not a slot sum")));
        };
        let (n, h, k) = (call.tokens, self.program.hidden, self.program.top_k);
        let sw = self.words(slots, 0, 2 * n * k)?;
        let ow = self.words(dst, 0, n * h)?;
        let s = self.arena.get(sw)?.to_vec();
        // Each local expert's scaled rows, as many as its slots in this call.
        let mut values = Vec::with_capacity(experts.len());
        for &(id, _, v) in experts {
            let rows = s.chunks_exact(2).filter(|p| p[0] == id).count();
            let w = self.words(v, 0, rows * h)?;
            values.push(f32s(self.arena.get(w)?).to_vec());
        }
        let ([], [out]) = self.arena.split([], [ow])?;
        let out = f32s_mut(out);
        out.fill(0.0);
        let mut cursor = vec![0usize; experts.len()];
        for t in 0..n {
            let acc = &mut out[t * h..(t + 1) * h];
            for j in 0..k {
                let e = s[2 * (t * k + j)];
                if e == Slot::EMPTY.expert {
                    continue;
                }
                let Some(local) = experts.iter().position(|x| x.0 == e) else {
                    return Err(Error::Request(format!(
                        "token {t} slot {j} names expert {e}, which this card does not hold in this layer"
                    )));
                };
                let row = cursor[local];
                cursor[local] += 1;
                for (a, v) in acc.iter_mut().zip(&values[local][row * h..(row + 1) * h]) {
                    *a += v;
                }
            }
        }
        Ok(())
    }

    fn propose(
        &mut self,
        logits: RegionId,
        dst: RegionId,
        call: &Call<'_>,
    ) -> Result<Vec<LmProposal>> {
        let shard = self
            .program
            .lm_head
            .as_ref()
            .map(|l| l.rows)
            .ok_or_else(|| Error::Request("this card holds no LM-head rows".into()))?;
        let (n, rows) = (call.tokens, shard.len());
        let lw = self.words(logits, 0, rows * n)?;
        let all = f32s(self.arena.get(lw)?);
        // `[token][vocab row]`: each token's logits contiguous. Reading `all` row by row keeps
        // the writes within `n` lines, where gathering a token's column would touch a line per
        // vocabulary row; the 16 floats of padding per token keep those lines out of one cache
        // set (shard widths are often a power of two).
        let stride = rows + 16;
        let mut by_token = vec![0f32; n * stride];
        for (v, logits) in all.chunks_exact(n.max(1)).take(rows).enumerate() {
            for (t, &l) in logits.iter().enumerate() {
                by_token[t * stride + v] = l;
            }
        }
        let propose_row = |t: usize| {
            propose(
                &by_token[t * stride..t * stride + rows],
                shard.start as u32,
                &call.sampling[t],
                &call.candidates,
            )
        };
        let proposals: Vec<LmProposal> = match &self.pool {
            Some(pool) => pool.install(|| (0..n).into_par_iter().map(propose_row).collect()),
            None => (0..n).map(propose_row).collect(),
        };
        // The proposal buffer (what goes on the wire): per token, the first candidates that fit.
        let per = (self.program.region(dst).bytes as usize / 4) / self.program.max_tokens;
        let ow = self.words(dst, 0, n * per)?;
        let ([], [out]) = self.arena.split([], [ow])?;
        out.fill(0);
        for (p, words) in proposals.iter().zip(out.chunks_exact_mut(per)) {
            let fixed = (crate::compiler::PROPOSAL_FIXED_BYTES / 4) as usize;
            let (head, cands) = words.split_at_mut(fixed);
            head[..2].copy_from_slice(bytemuck::cast_slice(&[p.log_sum_exp.unwrap_or(f64::NAN)]));
            head[2..4].copy_from_slice(bytemuck::cast_slice(&[p
                .scaled_log_sum_exp
                .unwrap_or(f64::NAN)]));
            if let Some(g) = p.gumbel {
                head[4] = g.token;
                head[6..8].copy_from_slice(bytemuck::cast_slice(&[g.score]));
            }
            for (c, pair) in p.candidates.iter().zip(cands.chunks_exact_mut(2)) {
                pair[0] = c.logit.to_bits();
                pair[1] = c.token;
            }
        }
        Ok(proposals)
    }

    /// The shard's logits `[n, rows]` of the last LM-head call (the full-logits fallback).
    pub fn logits(&self, n: usize) -> Result<Vec<f32>> {
        let lm = self
            .program
            .lm_head
            .as_ref()
            .ok_or_else(|| Error::Request("this card holds no LM-head rows".into()))?;
        let rows = lm.rows.len();
        let all = f32s(self.arena.get(self.words(lm.logits, 0, rows * n)?)?);
        Ok((0..n)
            .flat_map(|t| (0..rows).map(move |v| all[v * n + t]))
            .collect())
    }
}

/// Floats of tile `t`'s partials for `tokens` tokens. The host packs the tiles' partials
/// one after another for the call's tokens, instead of at their card offsets (room for the
/// program's most tokens each): for one token, GPT-OSS-20B's 270 tiles an expert would
/// otherwise write 128 bytes into each of 270 pages, a TLB miss each in the kernel and again
/// in `reduce`.
fn packed_partials(m: &Matrix, t: &Tile, tokens: usize) -> usize {
    tokens * t.rows.len() * partials_layout(m, t).per_row(t.segments.len())
}

/// How tile `t`'s partials are kept: a tile spanning the whole reduction adds its segments up
/// as the kernel makes them (one float a row instead of one a segment, and no pass over them
/// in `reduce`), with the same additions in the same order.
fn partials_layout(m: &Matrix, t: &Tile) -> PartialsLayout {
    if m.tile_folds_segments(t) {
        PartialsLayout::Folded
    } else {
        PartialsLayout::Segments
    }
}
