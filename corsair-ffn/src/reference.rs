//! The software model of a program's numerics: plain scalar loops written from the definition
//! in [`crate::numerics`], one token and one output at a time, reading the checkpoint's weights
//! through the card's format (decoded, or quantized then dequantized).
//!
//! It ignores tiles, cores, threads, placement and batching on purpose: the executor must give
//! the same bits whatever those are. It is slow, for tests.

use crate::error::{Error, Result};
use crate::executor::Slot;
use crate::format::{card_values, encode_row};
use crate::lm_head::{CandidateOptions, LmProposal, RowSampling, propose};
use crate::numerics::{dot, dot_bf16, dot_mxint8};
use crate::program::{ActivationSpec, LayerKind, Program};
use crate::weights::{MatrixSource, WeightSource};
use model::kernels::ActivationDtype;

/// A program's numerics evaluated plainly.
pub struct SoftwareModel<'a> {
    program: &'a Program,
    source: &'a dyn WeightSource,
}

impl<'a> SoftwareModel<'a> {
    /// The model of `program` over `source`'s weights.
    pub fn new(program: &'a Program, source: &'a dyn WeightSource) -> Self {
        SoftwareModel { program, source }
    }

    /// `y = W x + b` of matrix `m` for one input row, output by output.
    pub fn matvec(&self, m: usize, x: &[f32]) -> Result<Vec<f32>> {
        let matrix = &self.program.matrices[m];
        let src = MatrixSource::find(self.program, matrix, self.source)?;
        Ok((0..matrix.rows)
            .map(|r| {
                let (w, row) = src.row(r);
                let y = match matrix.activations {
                    ActivationDtype::Bf16 => {
                        dot_bf16(&card_values(w, row, src.cols, matrix.format), x)
                    }
                    ActivationDtype::F32 => dot(&card_values(w, row, src.cols, matrix.format), x),
                    ActivationDtype::Mxint8 => {
                        // The row's stored bytes: the order reads integers and scale bytes.
                        let (f, k) = (matrix.format, src.cols.len());
                        let mut data = vec![0u8; f.data_bytes(k)];
                        let mut scales = vec![0u8; f.scale_bytes(k)];
                        encode_row(w, row, src.cols, f, 0, k, &mut data, &mut scales);
                        dot_mxint8(f.block_format(), &data, &scales, x)
                    }
                };
                match &src.bias {
                    Some(b) => y + b[r],
                    None => y,
                }
            })
            .collect())
    }

    /// gate_up -> activation -> down for one input row.
    fn ffn(&self, (gate_up, down): (u32, u32), act: ActivationSpec, x: &[f32]) -> Result<Vec<f32>> {
        let gu = self.matvec(gate_up as usize, x)?;
        let width = gu.len() / 2;
        let a: Vec<f32> = (0..width)
            .map(|i| model::kernels::activate(act.into(), gu[i], gu[width + i]))
            .collect();
        self.matvec(down as usize, &a)
    }

    /// One expert of `layer` on one input row.
    pub fn expert(&self, layer: usize, expert: u32, x: &[f32]) -> Result<Vec<f32>> {
        let Some(LayerKind::Moe { experts, matrices }) =
            self.program.layers.get(layer).map(|l| &l.kind)
        else {
            return Err(Error::Request(format!("layer {layer} is not a MoE layer")));
        };
        let local = experts
            .iter()
            .position(|&e| e == expert)
            .ok_or_else(|| Error::Request(format!("expert {expert} is not on this card")))?;
        self.ffn(matrices[local], self.program.expert_activation, x)
    }

    /// A MoE layer (same contract as [`crate::Card::moe_layer`]).
    pub fn moe_layer(&self, layer: usize, rows: &[f32], slots: &[Slot]) -> Result<Vec<f32>> {
        let (h, k) = (self.program.hidden, self.program.top_k);
        let mut out = vec![0f32; rows.len()];
        for (t, x) in rows.chunks_exact(h).enumerate() {
            for slot in &slots[t * k..(t + 1) * k] {
                if *slot == Slot::EMPTY {
                    continue;
                }
                let y = self.expert(layer, slot.expert, x)?;
                for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(y) {
                    *o += v * slot.weight;
                }
            }
        }
        Ok(out)
    }

    /// A dense layer slice (same contract as [`crate::Card::dense_layer`]).
    pub fn dense_layer(&self, layer: usize, x: &[f32]) -> Result<Vec<f32>> {
        let h = self.program.hidden;
        let Some(LayerKind::Dense { matrices, .. }) =
            self.program.layers.get(layer).map(|l| &l.kind)
        else {
            return Err(Error::Request(format!(
                "layer {layer} is not a dense layer"
            )));
        };
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks_exact(h) {
            match matrices {
                Some(pair) => out.extend(self.ffn(*pair, ActivationSpec::SwiGlu, row)?),
                None => out.extend(std::iter::repeat_n(0.0, h)),
            }
        }
        Ok(out)
    }

    /// The shard's logits of one row.
    pub fn lm_logits(&self, x: &[f32]) -> Result<Vec<f32>> {
        let lm = self
            .program
            .lm_head
            .as_ref()
            .ok_or_else(|| Error::Request("no LM-head rows".into()))?;
        self.matvec(lm.matrix as usize, x)
    }

    /// LM-head proposals (same contract as [`crate::Card::lm_head`]).
    pub fn lm_head(
        &self,
        x: &[f32],
        rows: &[RowSampling],
        options: &CandidateOptions,
    ) -> Result<Vec<LmProposal>> {
        let lm = self
            .program
            .lm_head
            .as_ref()
            .ok_or_else(|| Error::Request("no LM-head rows".into()))?;
        x.chunks_exact(self.program.hidden)
            .zip(rows)
            .map(|(row, s)| {
                Ok(propose(
                    &self.lm_logits(row)?,
                    lm.rows.start as u32,
                    s,
                    options,
                ))
            })
            .collect()
    }
}
