//! The transient SRAM pool as the executor holds it: 32-bit words at the program's pool
//! addresses, so buffers that the memory plan overlaps really share storage here too.

use crate::error::{Error, Result};
use crate::program::{Program, RegionId};

/// The pool's words.
#[derive(Debug, Clone, Default)]
pub(crate) struct Arena {
    words: Vec<u32>,
}

/// Word range `[start, end)` of a region in the arena.
pub(crate) type Words = std::ops::Range<usize>;

/// Shared views of `R` ranges and exclusive views of `W` ranges.
pub(crate) type Views<'a, const R: usize, const W: usize> = ([&'a [u32]; R], [&'a mut [u32]; W]);

impl Arena {
    pub fn new(program: &Program) -> Self {
        Arena {
            words: vec![0; program.pool_bytes.div_ceil(4) as usize],
        }
    }

    /// Words of region `id` (a pool region) from word `offset`, `len` words.
    pub fn range(program: &Program, id: RegionId, offset: usize, len: usize) -> Result<Words> {
        let r = program
            .regions
            .get(id as usize)
            .ok_or_else(|| Error::Request(format!("region {id} does not exist")))?;
        if r.address < program.pool_base || !(r.address - program.pool_base).is_multiple_of(4) {
            return Err(Error::Request(format!("{} is not a pool region", r.name)));
        }
        if (offset + len) as u64 * 4 > r.bytes {
            return Err(Error::Request(format!(
                "{} holds {} bytes; {} words from word {offset} do not fit (more tokens than the program's max_tokens?)",
                r.name, r.bytes, len
            )));
        }
        let start = ((r.address - program.pool_base) / 4) as usize + offset;
        Ok(start..start + len)
    }

    /// Shared views of `reads` and exclusive views of `writes`, which must not overlap each
    /// other or any read (the sanitizer proves it for every compiled program; checked again
    /// here so a bad program fails instead of aliasing).
    pub fn split<const R: usize, const W: usize>(
        &mut self,
        reads: [Words; R],
        writes: [Words; W],
    ) -> Result<Views<'_, R, W>> {
        let len = self.words.len();
        let all = reads.iter().chain(writes.iter());
        if all.clone().any(|r| r.start > r.end || r.end > len) {
            return Err(Error::Request(
                "a buffer lies outside the card's pool".into(),
            ));
        }
        for (i, w) in writes.iter().enumerate() {
            let overlaps =
                |o: &Words| o.start < w.end && w.start < o.end && !o.is_empty() && !w.is_empty();
            if reads.iter().any(overlaps)
                || writes
                    .iter()
                    .enumerate()
                    .any(|(j, o)| j != i && overlaps(o))
            {
                return Err(Error::Request(
                    "a buffer written by an instruction overlaps another it uses".into(),
                ));
            }
        }
        let base = self.words.as_mut_ptr();
        // SAFETY: every range is inside the allocation (checked above); no exclusive range
        // overlaps any other range, so the shared and exclusive slices never alias; all borrow
        // `self` mutably for their lifetime, so nothing else touches the words meanwhile.
        unsafe {
            let reads =
                reads.map(|r| std::slice::from_raw_parts(base.add(r.start).cast_const(), r.len()));
            let writes = writes.map(|w| std::slice::from_raw_parts_mut(base.add(w.start), w.len()));
            Ok((reads, writes))
        }
    }

    /// The words of `range`, shared.
    pub fn get(&self, range: Words) -> Result<&[u32]> {
        self.words
            .get(range)
            .ok_or_else(|| Error::Request("a buffer lies outside the card's pool".into()))
    }
}

/// f32 view of words.
pub(crate) fn f32s(w: &[u32]) -> &[f32] {
    bytemuck::cast_slice(w)
}

/// Mutable f32 view of words.
pub(crate) fn f32s_mut(w: &mut [u32]) -> &mut [f32] {
    bytemuck::cast_slice_mut(w)
}
