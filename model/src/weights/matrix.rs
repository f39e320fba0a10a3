//! [`WeightMatrix`]: a 2-D weight `[rows = out, cols = in]` in the format it is stored in.
//!
//! Rows may be a strided selection of a larger stored tensor (one expert of a fused
//! `[E * 2I, H]` tensor, the gate rows of an interleaved gate/up matrix), so selecting never
//! copies. Values are decoded to f32 one row at a time, inside the kernels.

use std::sync::{Arc, OnceLock};

use crate::checkpoint::{SharedBytes, StoredDtype, StoredTensor};
use crate::error::{Error, Result};
use crate::kernels::ActivationDtype;
use crate::mxfp4;

/// How the elements of a weight matrix are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// MXFP4 blocks of 32 with an E8M0 scale.
    Mxfp4,
}

impl WeightFormat {
    /// Bytes one row of `cols` elements takes (blocks plus scales for MXFP4).
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            WeightFormat::F32 => cols * 4,
            WeightFormat::Bf16 | WeightFormat::F16 => cols * 2,
            WeightFormat::Mxfp4 => cols / mxfp4::BLOCK * (mxfp4::BLOCK_BYTES + 1),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::F16 => "f16",
            WeightFormat::Mxfp4 => "mxfp4",
        })
    }
}

/// A weight matrix `[rows, cols]`, `out x in` like `nn.Linear.weight`.
#[derive(Debug, Clone)]
pub struct WeightMatrix {
    rows: usize,
    cols: usize,
    format: WeightFormat,
    /// Dense elements `[physical rows, cols]`, or MXFP4 blocks `[physical rows, cols / 32, 16]`.
    data: SharedBytes,
    /// MXFP4 scales `[physical rows, cols / 32]`.
    scales: Option<SharedBytes>,
    first_row: usize,
    row_step: usize,
    /// What products with this matrix round their inputs to (see [`ActivationDtype`]).
    activations: ActivationDtype,
    /// [`Self::smallest_exponent`], worked out on first use and shared by every view of the
    /// same bytes.
    smallest_exponent: Arc<OnceLock<Option<u32>>>,
}

impl WeightMatrix {
    /// A dense matrix over the bytes of `tensor`, whose element count must be `rows * cols`.
    pub fn dense(tensor: &StoredTensor, rows: usize, cols: usize) -> Result<Self> {
        let format = match tensor.dtype {
            StoredDtype::F32 => WeightFormat::F32,
            StoredDtype::Bf16 => WeightFormat::Bf16,
            StoredDtype::F16 => WeightFormat::F16,
            _ => return Err(tensor.unsupported("F32, BF16 or F16")),
        };
        if tensor.shape.iter().product::<usize>() != rows * cols {
            return Err(Error::ShapeMismatch {
                file: tensor.file.clone(),
                tensor: tensor.name.clone(),
                expected: vec![rows, cols],
                actual: tensor.shape.clone(),
            });
        }
        Ok(Self::from_bytes(format, rows, cols, tensor.bytes.clone()))
    }

    /// A dense matrix over raw little-endian bytes of `format`.
    pub fn from_bytes(format: WeightFormat, rows: usize, cols: usize, data: SharedBytes) -> Self {
        assert!(format != WeightFormat::Mxfp4, "use WeightMatrix::mxfp4");
        assert_eq!(
            data.len(),
            rows * format.row_bytes(cols),
            "dense matrix byte count"
        );
        WeightMatrix {
            rows,
            cols,
            format,
            data: data.aligned(4),
            scales: None,
            first_row: 0,
            row_step: 1,
            activations: ActivationDtype::F32,
            smallest_exponent: Arc::default(),
        }
    }

    /// An f32 matrix owning `values` (`rows * cols`, row-major).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        Self::from_bytes(WeightFormat::F32, rows, cols, SharedBytes::from_f32(values))
    }

    /// An MXFP4 matrix over packed `blocks` (`rows * cols / 2` bytes) and `scales`
    /// (`rows * cols / 32` bytes).
    pub fn mxfp4(rows: usize, cols: usize, blocks: SharedBytes, scales: SharedBytes) -> Self {
        assert_eq!(
            cols % mxfp4::BLOCK,
            0,
            "MXFP4 columns must be a multiple of 32"
        );
        assert_eq!(blocks.len(), rows * cols / 2, "MXFP4 block byte count");
        assert_eq!(
            scales.len(),
            rows * cols / mxfp4::BLOCK,
            "MXFP4 scale byte count"
        );
        WeightMatrix {
            rows,
            cols,
            format: WeightFormat::Mxfp4,
            data: blocks,
            scales: Some(scales),
            first_row: 0,
            row_step: 1,
            activations: ActivationDtype::F32,
            smallest_exponent: Arc::default(),
        }
    }

    /// The byte ranges behind the matrix (the data, and MXFP4's scales), to move them
    /// ([`crate::checkpoint::move_to_huge_pages`]).
    pub(crate) fn byte_ranges_mut(&mut self) -> impl Iterator<Item = &mut SharedBytes> {
        std::iter::once(&mut self.data).chain(self.scales.as_mut())
    }

    /// The same matrix, its products rounding their inputs as `dtype` says (where the format
    /// allows: [`ActivationDtype::rounds`]).
    pub fn with_activations(mut self, dtype: ActivationDtype) -> Self {
        self.set_activations(dtype);
        self
    }

    /// Makes this matrix's products round their inputs as `dtype` says (see
    /// [`Self::with_activations`]).
    pub fn set_activations(&mut self, dtype: ActivationDtype) {
        self.activations = dtype;
    }

    /// What products with this matrix round their inputs to.
    pub fn activations(&self) -> ActivationDtype {
        self.activations
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Bytes the selected rows occupy in their stored format.
    pub fn stored_bytes(&self) -> usize {
        self.rows * self.format.row_bytes(self.cols)
    }

    /// For a bf16 matrix, the biased exponent of the smallest nonzero magnitude among all its
    /// stored elements (`Some(None)`: all zero; `Some(Some(0))`: one is below the normal
    /// range), read through once and then remembered; `None` for other formats. A row
    /// selection answers for the whole stored tensor, which bounds its own rows from below.
    pub fn smallest_exponent(&self) -> Option<Option<u32>> {
        if self.format != WeightFormat::Bf16 {
            return None;
        }
        Some(*self.smallest_exponent.get_or_init(|| {
            // Magnitude bits minus one: zeros wrap to the largest value, as in the kernels.
            let least = |m: u16, bits: u16| m.min((u16::from_le(bits) & 0x7fff).wrapping_sub(1));
            let bytes = self.data.as_bytes();
            // Dense data is 4-byte aligned (`from_bytes`): read as u16s, which vectorizes.
            let least = match bytemuck::try_cast_slice::<u8, u16>(bytes) {
                Ok(elements) => elements.iter().fold(u16::MAX, |m, &b| least(m, b)),
                Err(_) => bytes
                    .chunks_exact(2)
                    .fold(u16::MAX, |m, b| least(m, u16::from_ne_bytes([b[0], b[1]]))),
            };
            (least != u16::MAX).then_some((u32::from(least) + 1) >> 7)
        }))
    }

    /// Rows `start, start + step, ...` (`count` of them), without copying.
    pub fn select_rows(&self, start: usize, step: usize, count: usize) -> Self {
        assert!(step >= 1 && count >= 1, "empty row selection");
        assert!(
            start + (count - 1) * step < self.rows,
            "row selection out of range"
        );
        WeightMatrix {
            rows: count,
            first_row: self.first_row + start * self.row_step,
            row_step: self.row_step * step,
            ..self.clone()
        }
    }

    /// Whether the matrix is read where it lies in the memory-mapped checkpoint (not from a
    /// copy made at load: a transposed tensor, huge pages).
    pub fn is_mapped(&self) -> bool {
        self.data.is_mapped()
    }

    /// Drops the stored bytes of rows `start..start + count` (and of any rows stored between
    /// them) from this process's page tables where they are mapped from the checkpoint (see
    /// [`SharedBytes::release_pages`]): for loaders that have copied the rows elsewhere. The
    /// matrix reads the same afterwards.
    pub fn release_rows(&self, start: usize, count: usize) {
        if count == 0 {
            return;
        }
        assert!(start + count <= self.rows, "row release out of range");
        let (first, last) = (
            self.physical_row(start),
            self.physical_row(start + count - 1),
        );
        let per_row = self.data_per_row();
        self.data
            .release_pages(first * per_row, (last + 1 - first) * per_row);
        if let Some(s) = &self.scales {
            let per_row = self.cols / mxfp4::BLOCK;
            s.release_pages(first * per_row, (last + 1 - first) * per_row);
        }
    }

    fn physical_row(&self, r: usize) -> usize {
        debug_assert!(r < self.rows);
        self.first_row + r * self.row_step
    }

    /// Raw stored bytes of row `r` (for MXFP4, its packed blocks; see [`Self::row_scales`]).
    pub fn row_bytes(&self, r: usize) -> &[u8] {
        let per_row = self.data_per_row();
        let p = self.physical_row(r);
        &self.data.as_bytes()[p * per_row..(p + 1) * per_row]
    }

    /// Data bytes of one stored row (for MXFP4, its packed blocks).
    fn data_per_row(&self) -> usize {
        match self.format {
            WeightFormat::Mxfp4 => self.cols / 2,
            f => f.row_bytes(self.cols),
        }
    }

    /// The stored bytes from row `r` to the end of the storage, and the bytes from one selected
    /// row to the next (for kernels that walk several rows from one base).
    pub fn rows_from(&self, r: usize) -> (&[u8], usize) {
        let per_row = self.data_per_row();
        (
            &self.data.as_bytes()[self.physical_row(r) * per_row..],
            per_row * self.row_step,
        )
    }

    /// [`Self::rows_from`] for the MXFP4 scales (empty, 0 for dense formats).
    pub fn scales_from(&self, r: usize) -> (&[u8], usize) {
        match &self.scales {
            Some(s) => {
                let per_row = self.cols / mxfp4::BLOCK;
                (
                    &s.as_bytes()[self.physical_row(r) * per_row..],
                    per_row * self.row_step,
                )
            }
            None => (&[], 0),
        }
    }

    /// MXFP4 scale bytes of row `r` (empty for dense formats).
    pub fn row_scales(&self, r: usize) -> &[u8] {
        match &self.scales {
            Some(s) => {
                let per_row = self.cols / mxfp4::BLOCK;
                let p = self.physical_row(r);
                &s.as_bytes()[p * per_row..(p + 1) * per_row]
            }
            None => &[],
        }
    }

    /// Decodes row `r` into `out` (`cols` values).
    #[inline(always)]
    pub fn decode_row(&self, r: usize, scale_lut: &[f32; 256], out: &mut [f32]) {
        let bytes = self.row_bytes(r);
        match self.format {
            WeightFormat::F32 => {
                let src: &[f32] = bytemuck::cast_slice(bytes);
                out.copy_from_slice(src);
            }
            WeightFormat::Bf16 => {
                let src: &[u16] = bytemuck::cast_slice(bytes);
                for (o, &b) in out.iter_mut().zip(src) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            WeightFormat::F16 => {
                let src: &[u16] = bytemuck::cast_slice(bytes);
                for (o, &b) in out.iter_mut().zip(src) {
                    *o = half::f16::from_bits(b).to_f32();
                }
            }
            WeightFormat::Mxfp4 => mxfp4::decode_row(bytes, self.row_scales(r), scale_lut, out),
        }
    }

    /// Element `(r, k)` decoded to f32 (for kernel tails; slow per element).
    pub fn element(&self, r: usize, k: usize) -> f32 {
        let scale = match self.format {
            WeightFormat::Mxfp4 => self.row_scales(r)[k / mxfp4::BLOCK],
            _ => 0,
        };
        let format = crate::kernels::BlockFormat::of(self.format);
        crate::kernels::decode_value(format, self.row_bytes(r), k, scale)
    }

    /// The whole matrix decoded to f32, row-major (for small matrices and tests).
    pub fn to_f32(&self) -> Vec<f32> {
        let lut = mxfp4::scale_table();
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.decode_row(r, lut, row);
        }
        out
    }
}
