//! Binding weights to a compiled program: where each matrix row comes from in the checkpoint
//! ([`MatrixSource`]), and the card's memories on the host with every tile and bias written
//! in the program's storage format ([`BoundMemory`], [`bind`]).

use model::weights::{FfnWeights, GatedMlp};
use model::{ModelWeights, WeightMatrix};

use crate::assignment::{LayerShare, Span};
use crate::error::{Error, Result};
use crate::format::TileFormat;
use crate::program::{Matrix, MatrixRole, Program};

/// Where a card's weights come from: a loaded checkpoint, or weights made in memory.
pub trait WeightSource {
    /// Expert `expert` of layer `layer`, if loaded.
    fn expert(&self, layer: usize, expert: usize) -> Option<&GatedMlp>;
    /// The dense FFN of layer `layer`, if it is dense.
    fn dense(&self, layer: usize) -> Option<&GatedMlp>;
    /// The LM head `[vocab, hidden]`.
    fn lm_head(&self) -> Option<&WeightMatrix>;
}

impl WeightSource for ModelWeights {
    fn expert(&self, layer: usize, expert: usize) -> Option<&GatedMlp> {
        match &self.layers.get(layer)?.ffn {
            FfnWeights::Moe(m) => m.experts.get(expert)?.as_ref(),
            FfnWeights::Dense(_) => None,
        }
    }

    fn dense(&self, layer: usize) -> Option<&GatedMlp> {
        match &self.layers.get(layer)?.ffn {
            FfnWeights::Dense(m) => Some(&**m),
            FfnWeights::Moe(_) => None,
        }
    }

    fn lm_head(&self) -> Option<&WeightMatrix> {
        Some(&self.lm_head)
    }
}

/// The checkpoint rows behind one card matrix: row `r` of the card matrix is row
/// `first + (r - offset)` of the part holding it, restricted to columns `cols`.
pub struct MatrixSource<'a> {
    parts: Vec<(&'a WeightMatrix, usize, usize)>,
    /// Columns of the source rows that make the card's row.
    pub cols: Span,
    /// The bias (card rows), if any.
    pub bias: Option<Vec<f32>>,
}

impl<'a> MatrixSource<'a> {
    /// The source matrix and row of card row `r`.
    pub fn row(&self, mut r: usize) -> (&'a WeightMatrix, usize) {
        for &(m, first, count) in &self.parts {
            if r < count {
                return (m, first + r);
            }
            r -= count;
        }
        // Callers iterate over the matrix's own rows, which the parts cover (checked at build).
        let (m, first, count) = self.parts[self.parts.len() - 1];
        (m, first + count - 1)
    }

    /// Drops the source rows' checkpoint pages from this process's page tables (see
    /// [`WeightMatrix::release_rows`]), once they are written to the card.
    pub fn release_pages(&self) {
        for &(m, first, count) in &self.parts {
            m.release_rows(first, count);
        }
    }

    /// Finds the rows of `matrix` of `program` in `source`, checking shapes and formats.
    pub fn find(program: &Program, matrix: &Matrix, source: &'a dyn WeightSource) -> Result<Self> {
        let missing = |what: String| {
            Error::Weights(format!(
                "the program needs {what} ({}) but the weights do not include it; load the checkpoint \
                 with this card's expert filter (CardAssignment::expert_filter)",
                matrix.name
            ))
        };
        let layer_mlp = |layer: u32, expert: Option<u32>| -> Result<&'a GatedMlp> {
            match expert {
                Some(e) => source
                    .expert(layer as usize, e as usize)
                    .ok_or_else(|| missing(format!("expert {e} of layer {layer}"))),
                None => source
                    .dense(layer as usize)
                    .ok_or_else(|| missing(format!("the dense FFN of layer {layer}"))),
            }
        };
        let columns = |layer: u32, expert: Option<u32>, full: usize| match (
            expert,
            program.assignment.layers.get(layer as usize),
        ) {
            (None, Some(LayerShare::Dense { columns })) => *columns,
            _ => Span::new(0, full),
        };
        let concat = |a: &Option<Vec<f32>>, b: &Option<Vec<f32>>, span: Span| match (a, b) {
            (Some(a), Some(b)) => {
                Some([&a[span.start..span.end], &b[span.start..span.end]].concat())
            }
            _ => None,
        };
        let src = match matrix.role {
            MatrixRole::GateUp { layer, expert } => {
                let mlp = layer_mlp(layer, expert)?;
                let c = columns(layer, expert, mlp.gate.weight.rows());
                MatrixSource {
                    parts: vec![
                        (&mlp.gate.weight, c.start, c.len()),
                        (&mlp.up.weight, c.start, c.len()),
                    ],
                    cols: Span::new(0, mlp.gate.weight.cols()),
                    bias: concat(&mlp.gate.bias, &mlp.up.bias, c),
                }
            }
            MatrixRole::Down { layer, expert } => {
                let mlp = layer_mlp(layer, expert)?;
                let c = columns(layer, expert, mlp.down.weight.cols());
                let bias = if c.start == 0 {
                    mlp.down.bias.clone()
                } else {
                    None
                };
                MatrixSource {
                    parts: vec![(&mlp.down.weight, 0, mlp.down.weight.rows())],
                    cols: c,
                    bias,
                }
            }
            MatrixRole::LmHead => {
                let lm = source
                    .lm_head()
                    .ok_or_else(|| missing("the LM head".into()))?;
                let rows = program.lm_head.as_ref().map_or(Span::new(0, 0), |l| l.rows);
                MatrixSource {
                    parts: vec![(lm, rows.start, rows.len())],
                    cols: Span::new(0, lm.cols()),
                    bias: None,
                }
            }
        };
        let rows: usize = src.parts.iter().map(|p| p.2).sum();
        let fits = src
            .parts
            .iter()
            .all(|&(m, first, count)| first + count <= m.rows() && src.cols.end <= m.cols());
        if rows != matrix.rows || src.cols.len() != matrix.cols || !fits {
            return Err(Error::Weights(format!(
                "{} is compiled as [{}, {}] but the weights give [{rows}, {}]; recompile for this checkpoint",
                matrix.name,
                matrix.rows,
                matrix.cols,
                src.cols.len()
            )));
        }
        if let Some(&(m, _, _)) = src.parts.first() {
            let stored = TileFormat::from_stored(m.format());
            if stored != matrix.source_format {
                return Err(Error::Weights(format!(
                    "{} was compiled for a checkpoint storing {} but this one stores {stored}; recompile from its config.json",
                    matrix.name, matrix.source_format
                )));
            }
        }
        if src.bias.is_some() != matrix.bias.is_some() {
            return Err(Error::Weights(format!(
                "{}: the weights {} a bias but the program {}; recompile for this checkpoint",
                matrix.name,
                if src.bias.is_some() { "have" } else { "lack" },
                if matrix.bias.is_some() {
                    "expects one"
                } else {
                    "has none"
                }
            )));
        }
        Ok(src)
    }
}

mod bound;
pub use bound::{AlignedBytes, BoundMemory, bind};
