//! Safetensors checkpoints, single-file or sharded, memory-mapped.
//!
//! [`Checkpoint`] indexes every tensor of a Hugging Face checkpoint folder without reading the
//! data: tensors are byte ranges of memory-mapped files, handed out as [`SharedBytes`] so that
//! weights are used where they lie (MXFP4 blocks stay packed, bf16 stays bf16).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};

mod huge_pages;

pub use huge_pages::move_to_huge_pages;

/// Where the bytes behind a [`SharedBytes`] live.
#[derive(Debug)]
enum Backing {
    /// A memory-mapped checkpoint file.
    Mapped(Mmap),
    /// Anonymous memory holding copies of mapped ranges ([`move_to_huge_pages`]).
    HugePages(Mmap),
    /// Bytes made at load time (a transposed tensor, a synthetic weight), kept 8-byte aligned.
    Owned { words: Vec<u64>, len: usize },
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) | Backing::HugePages(m) => m,
            Backing::Owned { words, len } => &bytemuck::cast_slice(words)[..*len],
        }
    }
}

/// A cheaply clonable, immutable byte range of a mapped file or of an owned buffer.
#[derive(Debug, Clone)]
pub struct SharedBytes {
    backing: Arc<Backing>,
    start: usize,
    len: usize,
}

impl SharedBytes {
    /// Takes ownership of `bytes` (copied once into an 8-byte aligned buffer).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        let mut words = vec![0u64; len.div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len].copy_from_slice(&bytes);
        SharedBytes {
            backing: Arc::new(Backing::Owned { words, len }),
            start: 0,
            len,
        }
    }

    /// Little-endian bytes of `values`.
    pub fn from_f32(values: &[f32]) -> Self {
        Self::from_vec(bytemuck::cast_slice(values).to_vec())
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.backing.bytes()[self.start..self.start + self.len]
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-range; `start + len` must be within this range.
    pub fn slice(&self, start: usize, len: usize) -> Self {
        assert!(start + len <= self.len, "SharedBytes::slice out of range");
        SharedBytes {
            backing: self.backing.clone(),
            start: self.start + start,
            len,
        }
    }

    /// Whether the bytes are read where they lie in a memory-mapped checkpoint file (rather
    /// than from memory made or copied at load).
    pub fn is_mapped(&self) -> bool {
        matches!(*self.backing, Backing::Mapped(_))
    }

    /// Drops the pages holding bytes `start..start + len` of this range from this process's
    /// page tables where they are mapped from the checkpoint file (not from the page cache):
    /// a loader that has copied them elsewhere stops counting them in its resident set. Whole
    /// pages go, so neighbouring bytes sharing the first or last page go too; a later read of
    /// any of them faults the page back in from the cache unchanged. Bytes in memory are left
    /// alone.
    pub fn release_pages(&self, start: usize, len: usize) {
        assert!(
            start + len <= self.len,
            "SharedBytes::release_pages out of range"
        );
        #[cfg(unix)]
        if let Backing::Mapped(map) = &*self.backing
            && len > 0
        {
            // SAFETY: the mapping is a read-only view of a file afd never writes, so discarding
            // its pages only makes the next access read the same bytes from the page cache; no
            // reference into them can observe a change. The range lies inside the mapping.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    self.start + start,
                    len,
                )
            };
        }
    }

    /// The same bytes, guaranteed aligned to `align` (copied only when they are not).
    pub fn aligned(self, align: usize) -> Self {
        if (self.as_bytes().as_ptr() as usize).is_multiple_of(align) {
            self
        } else {
            Self::from_vec(self.as_bytes().to_vec())
        }
    }
}

/// Element types afd reads from checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// Unsigned byte (MXFP4 blocks and E8M0 scales in Hugging Face checkpoints).
    U8,
    /// Anything else; kept for error messages.
    Other(Dtype),
}

impl StoredDtype {
    fn from_safetensors(d: Dtype) -> Self {
        match d {
            Dtype::F32 => StoredDtype::F32,
            Dtype::BF16 => StoredDtype::Bf16,
            Dtype::F16 => StoredDtype::F16,
            Dtype::U8 | Dtype::F8_E8M0 => StoredDtype::U8,
            other => StoredDtype::Other(other),
        }
    }

    /// Bytes per element (0 for types afd does not read).
    pub fn size(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::Bf16 | StoredDtype::F16 => 2,
            StoredDtype::U8 => 1,
            StoredDtype::Other(_) => 0,
        }
    }
}

impl std::fmt::Display for StoredDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoredDtype::F32 => f.write_str("F32"),
            StoredDtype::Bf16 => f.write_str("BF16"),
            StoredDtype::F16 => f.write_str("F16"),
            StoredDtype::U8 => f.write_str("U8"),
            StoredDtype::Other(d) => write!(f, "{d:?}"),
        }
    }
}

/// One tensor of a checkpoint: its name, type, shape and bytes.
#[derive(Debug, Clone)]
pub struct StoredTensor {
    /// Tensor name as in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: StoredDtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// The file it lives in.
    pub file: PathBuf,
    /// The raw little-endian bytes.
    pub bytes: SharedBytes,
}

impl StoredTensor {
    /// Fails with a clear error unless the shape is `expected`.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<&Self> {
        if self.shape != expected {
            return Err(Error::ShapeMismatch {
                file: self.file.clone(),
                tensor: self.name.clone(),
                expected: expected.to_vec(),
                actual: self.shape.clone(),
            });
        }
        Ok(self)
    }

    /// The values converted to f32 (for small tensors: norms, biases, sinks).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let b = self.bytes.as_bytes();
        Ok(match self.dtype {
            StoredDtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StoredDtype::Bf16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StoredDtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => return Err(self.unsupported("F32, BF16 or F16")),
        })
    }

    /// The error for a dtype that this use does not accept.
    pub fn unsupported(&self, expected: &'static str) -> Error {
        Error::UnsupportedDtype {
            file: self.file.clone(),
            tensor: self.name.clone(),
            dtype: self.dtype.to_string(),
            expected,
        }
    }
}

#[derive(Debug)]
struct Entry {
    file: usize,
    dtype: StoredDtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// An opened checkpoint folder: every tensor of every shard, indexed by name.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Arc<Backing>)>,
    entries: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let shard_names: Vec<String> = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let index: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::Json {
                    path: index_path.clone(),
                    what: "safetensors index",
                    source: e,
                })?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::JsonContent {
                    path: index_path.clone(),
                    what: "safetensors index",
                    message: "no `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect();
            names.sort();
            names.dedup();
            names
        } else if single.exists() {
            vec!["model.safetensors".to_owned()]
        } else {
            return Err(Error::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        let mut checkpoint = Checkpoint {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            entries: HashMap::new(),
        };
        for name in shard_names {
            checkpoint.add_file(&dir.join(name))?;
        }
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only; afd never writes checkpoint files while serving
        // them. A file truncated underneath a running process is outside what we can defend.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| Error::SafetensorsHeader {
                file: path.to_path_buf(),
                source: e,
            })?;
        let data_start = 8 + header_len;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            self.entries.insert(
                name,
                Entry {
                    file: file_index,
                    dtype: StoredDtype::from_safetensors(info.dtype),
                    shape: info.shape.clone(),
                    start: data_start + start,
                    end: data_start + end,
                },
            );
        }
        self.files
            .push((path.to_path_buf(), Arc::new(Backing::Mapped(mmap))));
        Ok(())
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// The tensor called `name`, or a clear error naming it.
    pub fn get(&self, name: &str) -> Result<StoredTensor> {
        let entry = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            dir: self.dir.clone(),
            tensor: name.to_owned(),
        })?;
        let (path, backing) = &self.files[entry.file];
        let bytes = SharedBytes {
            backing: backing.clone(),
            start: entry.start,
            len: entry.end - entry.start,
        };
        let tensor = StoredTensor {
            name: name.to_owned(),
            dtype: entry.dtype,
            shape: entry.shape.clone(),
            file: path.clone(),
            bytes,
        };
        let expected_len = tensor.shape.iter().product::<usize>() * entry.dtype.size();
        if entry.dtype.size() != 0 && expected_len != tensor.bytes.len() {
            return Err(Error::Safetensors {
                file: path.clone(),
                message: format!(
                    "tensor `{name}` has {} bytes for shape {:?}",
                    tensor.bytes.len(),
                    tensor.shape
                ),
            });
        }
        Ok(tensor)
    }

    /// A fingerprint of the checkpoint: a hash of config.json and of every tensor's name, dtype
    /// and shape (not of the data, which would mean reading every byte). Two nodes that should
    /// hold the same model compare fingerprints to refuse a mismatch early.
    pub fn fingerprint(&self) -> Result<String> {
        let config_path = self.dir.join("config.json");
        let config = std::fs::read(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let mut h: u64 = 0xcbf29ce484222325;
        let mut feed = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ b as u64).wrapping_mul(0x100000001b3);
            }
        };
        feed(&config);
        for name in self.names() {
            let e = &self.entries[name];
            feed(name.as_bytes());
            feed(format!("{}{:?}", e.dtype, e.shape).as_bytes());
        }
        Ok(format!("{h:016x}"))
    }

    /// The first of `names` that exists (checkpoints of one family spell some tensors
    /// differently), or an error naming the first.
    pub fn get_any(&self, names: &[String]) -> Result<StoredTensor> {
        for name in names {
            if self.contains(name) {
                return self.get(name);
            }
        }
        Err(Error::MissingTensor {
            dir: self.dir.clone(),
            tensor: names.join("` or `"),
        })
    }
}
