//! A streaming safetensors writer: the header is computed from the tensor list first, then
//! each tensor's bytes are produced and written one at a time, so a checkpoint of any size is
//! written with one tensor in memory and a progress callback between tensors.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// One tensor to be written.
#[derive(Debug, Clone)]
pub struct TensorPlan {
    /// Tensor name.
    pub name: String,
    /// Safetensors dtype string (`BF16`, `F32`, `U8`, ...).
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorPlan {
    /// Bytes of the tensor's data.
    pub fn byte_len(&self) -> usize {
        let elem = match self.dtype {
            "F32" | "I32" | "U32" => 4,
            "BF16" | "F16" => 2,
            _ => 1,
        };
        self.shape.iter().product::<usize>() * elem
    }
}

/// Writes `tensors` to `path`; `fill(i, buf)` must put exactly `tensors[i].byte_len()` bytes in
/// `buf` (cleared before each call). `progress(bytes)` is called after each tensor.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorPlan],
    mut fill: impl FnMut(usize, &mut Vec<u8>) -> Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for t in tensors {
        let len = t.byte_len();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + len] }),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&header).map_err(|source| Error::JsonWrite {
        path: path.to_path_buf(),
        source,
    })?;
    // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    while (8 + header.len()) % 8 != 0 {
        header.push(b' ');
    }
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut out = BufWriter::with_capacity(1 << 22, file);
    let io = |e| Error::io(path, e);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&header).map_err(io)?;
    let mut buf = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        buf.clear();
        fill(i, &mut buf)?;
        if buf.len() != t.byte_len() {
            return Err(Error::InvalidInput(format!(
                "synthetic tensor `{}` produced {} bytes, expected {}",
                t.name,
                buf.len(),
                t.byte_len()
            )));
        }
        out.write_all(&buf).map_err(io)?;
        progress(buf.len() as u64);
    }
    out.flush().map_err(io)?;
    Ok(())
}
