//! The experts' gated activation, one (gate, up) pair at a time: what the reference forward,
//! the cards' executor and their reference evaluator all apply between the two projections.

use crate::config::Activation;

/// The gated activation of one (gate, up) pair.
#[inline]
pub fn activate(act: Activation, gate: f32, up: f32) -> f32 {
    match act {
        Activation::SwiGlu => gate / (1.0 + (-gate).exp()) * up,
        Activation::ClampedSwiGlu { alpha, limit } => {
            let gate = gate.min(limit);
            let up = up.clamp(-limit, limit);
            let glu = gate * (1.0 / (1.0 + (-(gate * alpha)).exp()));
            (up + 1.0) * glu
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamped_swiglu_matches_formula() {
        let act = Activation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 7.0,
        };
        // gate above the limit is clamped to 7, up below -7 is clamped to -7.
        let v = activate(act, 9.0, -8.0);
        let glu = 7.0 * (1.0 / (1.0 + (-(7.0f32 * 1.702)).exp()));
        assert_eq!(v, (-7.0 + 1.0) * glu);
        // gate has no lower clamp.
        let v = activate(act, -9.0, 0.5);
        assert_eq!(v, 1.5 * (-9.0 * (1.0 / (1.0 + (9.0f32 * 1.702).exp()))));
    }

    #[test]
    fn swiglu_is_silu_of_the_gate_times_up() {
        let silu = |x: f32| x / (1.0 + (-x).exp());
        for (g, u) in [(0.0, 1.0), (2.5, -0.5), (-3.0, 4.0)] {
            assert_eq!(activate(Activation::SwiGlu, g, u), silu(g) * u);
        }
    }
}
