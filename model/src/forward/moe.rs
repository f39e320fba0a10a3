//! Routing and the expert math: top-k selection per family, the gated MLP of one expert (or
//! of a dense layer), and the reference combination of the selected experts.
//!
//! These are the functions the cards and the attention node reuse: the attention node routes
//! with [`route`], a card evaluates [`gated_mlp`] for its experts.

use crate::config::{Activation, MoeSpec, RouterKind};
use crate::error::Result;
use crate::kernels::{self, activate};
use crate::weights::{GatedMlp, Linear, MoeWeights};
use rayon::prelude::*;

/// The fewest activations one task of the pool computes (fewer cost more to hand over than to
/// compute).
const ACTIVATIONS_PER_TASK: usize = 8192;

/// The experts chosen for each token and their weights, `top_k` per token, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub top_k: usize,
    /// `[tokens * top_k]` expert ids.
    pub experts: Vec<u32>,
    /// `[tokens * top_k]` routing weights.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Number of tokens routed.
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }

    /// `(expert, weight)` pairs of token `t`.
    pub fn token(&self, t: usize) -> impl Iterator<Item = (u32, f32)> + '_ {
        let k = self.top_k;
        self.experts[t * k..(t + 1) * k]
            .iter()
            .copied()
            .zip(self.weights[t * k..(t + 1) * k].iter().copied())
    }
}

/// Softmax in f32 the way torch computes it: subtract the max, exponentiate, divide by the sum.
pub fn softmax_in_place(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in values.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in values.iter_mut() {
        *v /= sum;
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Routes `tokens` rows of normed hidden states `h` (`[tokens, hidden]`).
pub fn route(router: &Linear, spec: &MoeSpec, h: &[f32], tokens: usize) -> Routing {
    let logits = router.forward_rows(h, tokens);
    route_logits(&logits, spec)
}

/// Routing from router logits `[tokens, num_experts]`.
pub fn route_logits(logits: &[f32], spec: &MoeSpec) -> Routing {
    let e = spec.num_experts;
    let k = spec.top_k;
    let tokens = logits.len() / e;
    let mut experts = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for row in logits.chunks_exact(e) {
        match spec.router {
            RouterKind::TopKThenSoftmax => {
                let chosen = top_k(row, k);
                let mut w: Vec<f32> = chosen.iter().map(|&i| row[i]).collect();
                softmax_in_place(&mut w);
                experts.extend(chosen.iter().map(|&i| i as u32));
                weights.extend(w);
            }
            RouterKind::SoftmaxThenTopK { renormalize } => {
                let mut probs = row.to_vec();
                softmax_in_place(&mut probs);
                let chosen = top_k(&probs, k);
                let mut w: Vec<f32> = chosen.iter().map(|&i| probs[i]).collect();
                if renormalize {
                    let sum: f32 = w.iter().sum();
                    for x in &mut w {
                        *x /= sum;
                    }
                }
                experts.extend(chosen.iter().map(|&i| i as u32));
                weights.extend(w);
            }
        }
    }
    Routing {
        top_k: k,
        experts,
        weights,
    }
}

/// One gated MLP over `tokens` rows of `x` (`[tokens, hidden]`), giving `[tokens, hidden]`.
pub fn gated_mlp(mlp: &GatedMlp, act: Activation, x: &[f32], tokens: usize) -> Vec<f32> {
    if tokens == 1 {
        return gated_mlps(&[mlp], act, x).swap_remove(0);
    }
    let gate = mlp.gate.forward_rows(x, tokens);
    let up = mlp.up.forward_rows(x, tokens);
    // On the pool in long runs: a prompt's activations (64 tokens of a medium Mixtral's two
    // experts, 262,144 exponentials a layer) otherwise left the other core idle for about a
    // millisecond a layer. Element by element, so the same bits either way.
    let a: Vec<f32> = gate
        .par_iter()
        .zip(&up)
        .with_min_len(ACTIVATIONS_PER_TASK)
        .map(|(&g, &u)| activate(act, g, u))
        .collect();
    mlp.down.forward_rows(&a, tokens)
}

/// [`gated_mlp`] of every MLP in `mlps` on the same one token `x`, each with its bits: the
/// gate and up products of all of them in one parallel section, then the down products in
/// another (see [`kernels::matvecs`]).
pub fn gated_mlps(mlps: &[&GatedMlp], act: Activation, x: &[f32]) -> Vec<Vec<f32>> {
    let inter: Vec<usize> = mlps.iter().map(|m| m.gate.weight.rows()).collect();
    let mut gates: Vec<Vec<f32>> = inter.iter().map(|&n| vec![0f32; n]).collect();
    let mut ups: Vec<Vec<f32>> = inter.iter().map(|&n| vec![0f32; n]).collect();
    let mut jobs = Vec::with_capacity(2 * mlps.len());
    for ((m, g), u) in mlps.iter().zip(&mut gates).zip(&mut ups) {
        jobs.push(m.gate.matvec(x, g));
        jobs.push(m.up.matvec(x, u));
    }
    kernels::matvecs(jobs);
    let acts: Vec<Vec<f32>> = gates
        .iter()
        .zip(&ups)
        .map(|(g, u)| {
            g.iter()
                .zip(u)
                .map(|(&g, &u)| activate(act, g, u))
                .collect()
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = mlps
        .iter()
        .map(|m| vec![0f32; m.down.weight.rows()])
        .collect();
    let jobs = mlps
        .iter()
        .zip(&acts)
        .zip(&mut outs)
        .map(|((m, a), o)| m.down.matvec(a, o))
        .collect();
    kernels::matvecs(jobs);
    outs
}

/// The whole MoE layer for `tokens` rows of normed hidden states `h`, as the reference
/// computes it: every token's selected experts, weighted, summed in top-k order in f32.
pub fn moe_forward(
    moe: &MoeWeights,
    spec: &MoeSpec,
    h: &[f32],
    tokens: usize,
    hidden: usize,
) -> Result<Vec<f32>> {
    let routing = route(&moe.router, spec, h, tokens);
    let k = spec.top_k;
    if tokens == 1 {
        // Decode of one sequence: its experts' products side by side, then the same weighted
        // sum in top-k order as below.
        let experts = routing
            .experts
            .iter()
            .map(|&e| moe.expert(e as usize))
            .collect::<Result<Vec<_>>>()?;
        let ys = gated_mlps(&experts, spec.activation, &h[..hidden]);
        let mut out = vec![0f32; hidden];
        for (y, &w) in ys.iter().zip(&routing.weights) {
            for (d, s) in out.iter_mut().zip(y) {
                *d += s * w;
            }
        }
        return Ok(out);
    }
    // Per (token, slot) weighted expert output, then a fixed-order sum per token.
    let mut slots = vec![0f32; tokens * k * hidden];
    let mut rows_of_expert: Vec<Vec<usize>> = vec![Vec::new(); spec.num_experts];
    for (i, &e) in routing.experts.iter().enumerate() {
        rows_of_expert[e as usize].push(i);
    }
    for (e, slot_ids) in rows_of_expert.iter().enumerate() {
        if slot_ids.is_empty() {
            continue;
        }
        let expert = moe.expert(e)?;
        let mut x = Vec::with_capacity(slot_ids.len() * hidden);
        for &i in slot_ids {
            let t = i / k;
            x.extend_from_slice(&h[t * hidden..(t + 1) * hidden]);
        }
        let y = gated_mlp(expert, spec.activation, &x, slot_ids.len());
        for (r, &i) in slot_ids.iter().enumerate() {
            let w = routing.weights[i];
            for (dst, src) in slots[i * hidden..(i + 1) * hidden]
                .iter_mut()
                .zip(&y[r * hidden..(r + 1) * hidden])
            {
                *dst = src * w;
            }
        }
    }
    let mut out = vec![0f32; tokens * hidden];
    for t in 0..tokens {
        let dst = &mut out[t * hidden..(t + 1) * hidden];
        for j in 0..k {
            let src = &slots[(t * k + j) * hidden..(t * k + j + 1) * hidden];
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(router: RouterKind, k: usize) -> MoeSpec {
        MoeSpec {
            num_experts: 4,
            top_k: k,
            intermediate_size: 8,
            router,
            router_bias: false,
            expert_bias: false,
            activation: Activation::SwiGlu,
        }
    }

    #[test]
    fn gpt_oss_softmaxes_the_top_k_logits() {
        let r = route_logits(
            &[0.1, 2.0, -1.0, 1.0],
            &spec(RouterKind::TopKThenSoftmax, 2),
        );
        assert_eq!(r.experts, vec![1, 3]);
        let e = (1.0f32).exp();
        assert!((r.weights[0] - e / (e + 1.0)).abs() < 1e-6);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn qwen_without_renormalization_keeps_full_softmax_probabilities() {
        let logits = [0.1, 2.0, -1.0, 1.0];
        let plain = route_logits(
            &logits,
            &spec(RouterKind::SoftmaxThenTopK { renormalize: false }, 2),
        );
        let mut p = logits.to_vec();
        softmax_in_place(&mut p);
        assert_eq!(plain.weights, vec![p[1], p[3]]);
        let renorm = route_logits(
            &logits,
            &spec(RouterKind::SoftmaxThenTopK { renormalize: true }, 2),
        );
        assert!((renorm.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(renorm.experts, vec![1, 3]);
    }

    #[test]
    fn ties_prefer_lower_expert_ids() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 0.0], 2), vec![1, 2]);
    }
}
