//! The plan as a readable report (`afd plan` without `--json`).

use std::fmt;

use corsair_ffn::report::human_bytes;

use super::Plan;

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "deployment {}", self.deployment)?;
        writeln!(f, "  model: {}", self.model)?;
        let w = &self.workload;
        let what = if w.output_len == 0 {
            format!("one decode step at context {}", w.input_len)
        } else {
            format!("{} in / {} out", w.input_len, w.output_len)
        };
        writeln!(f, "  workload: batch {}, {what}", w.batch)?;
        let a = &self.attention;
        writeln!(
            f,
            "attention: {} node(s) on {}: weights {} + KV {} + reserved {} = {} of {} ({:.0}%)",
            a.nodes,
            a.device,
            human_bytes(a.weight_bytes),
            human_bytes(a.kv_bytes),
            human_bytes(a.reserved_bytes),
            human_bytes(a.total_bytes),
            human_bytes(a.available_bytes),
            pct(a.total_bytes, a.available_bytes)
        )?;
        if self.cards == 0 {
            writeln!(f, "cards: none (the attention device runs the whole model)")?;
        } else {
            writeln!(f, "cards: {}", self.cards)?;
            writeln!(
                f,
                "  {:>4}  {:>10}  {:>10}  {:>5}  {:>10}  by kind",
                "card", "SRAM need", "available", "use", "spilled"
            )?;
            for c in &self.per_card {
                if let Some(e) = &c.error {
                    writeln!(f, "  {:>4}  does not fit: {e}", c.card)?;
                    continue;
                }
                let kinds: Vec<String> = c
                    .sram_by_kind
                    .iter()
                    .map(|(k, b)| format!("{k} {}", human_bytes(*b)))
                    .collect();
                writeln!(
                    f,
                    "  {:>4}  {:>10}  {:>10}  {:>4.0}%  {:>10}  {}",
                    c.card,
                    human_bytes(c.sram_bytes_needed),
                    human_bytes(c.sram_bytes_available),
                    pct(c.sram_bytes_needed, c.sram_bytes_available),
                    if c.spilled_bytes == 0 {
                        "-".to_string()
                    } else {
                        human_bytes(c.spilled_bytes)
                    },
                    kinds.join(", ")
                )?;
            }
            if let Some(c) = self.per_card.first() {
                writeln!(f, "  card 0 holds {}", c.share)?;
            }
            if let Some(why) = &self.replication {
                let copies = if self.experts_replicated {
                    "a copy of every expert on the next card"
                } else {
                    "one copy of each expert"
                };
                writeln!(f, "  {copies} ({why})")?;
            }
            let survived: Vec<String> = self
                .card_losses
                .iter()
                .filter(|l| l.survived)
                .map(|l| l.card.to_string())
                .collect();
            if survived.len() == self.card_losses.len() {
                writeln!(
                    f,
                    "  survives the loss of any one card (replicas cover its experts, the \
                     attention node its LM-head rows)"
                )?;
            } else {
                let lost = self.card_losses.iter().filter(|l| !l.survived);
                let first = self.card_losses.iter().find(|l| !l.survived);
                writeln!(
                    f,
                    "  survives the loss of card(s): {}; not of card(s) {} ({})",
                    if survived.is_empty() {
                        "none".to_string()
                    } else {
                        survived.join(", ")
                    },
                    lost.map(|l| l.card.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    first.and_then(|l| l.reason.as_deref()).unwrap_or("")
                )?;
            }
        }
        if let Some(p) = &self.predicted {
            let b = &p.breakdown;
            let us = |s: f64| format!("{:.1} us", s * 1e6);
            writeln!(f, "predicted:")?;
            writeln!(
                f,
                "  TPOT {:.3} ms ({:.0} tok/s per user); decode step {:.3} ms; {:.0} output tok/s in all",
                p.tpot_ms, p.per_user_tokens_per_s, p.step_ms, p.output_tokens_per_s
            )?;
            if p.prefill_ms > 0.0 {
                writeln!(f, "  prefill of every prompt {:.1} ms", p.prefill_ms)?;
            }
            writeln!(
                f,
                "  step: {} micro-batch(es) of {} token(s) per node; layers {:.3} ms, LM head {}, embedding {}",
                b.micro_batches,
                b.micro_batch_tokens,
                b.layers_seconds * 1e3,
                us(b.lm_head_seconds),
                us(b.embedding_seconds)
            )?;
            if self.cards > 0 {
                writeln!(
                    f,
                    "  per layer: device {}, transfers {} and card {} per micro-batch; bound by the {}",
                    us(b.device_per_layer),
                    us(b.transfer_per_layer),
                    us(b.card_per_layer),
                    b.bound
                )?;
                if b.lm_head_exposed_stream > 0.0 {
                    writeln!(
                        f,
                        "  the LM-head stream from LPDDR is not hidden by the layers: {} exposed",
                        us(b.lm_head_exposed_stream)
                    )?;
                }
            } else {
                writeln!(f, "  per layer: device {}", us(b.device_per_layer))?;
            }
        }
        if !self.calibrated.is_empty() {
            writeln!(f, "calibrated constants: {}", self.calibrated.join(", "))?;
        }
        if self.fits {
            write!(f, "fits")
        } else {
            write!(f, "does NOT fit:")?;
            for p in &self.problems {
                write!(f, "\n  - {p}")?;
            }
            Ok(())
        }
    }
}
