//! Copies of mapped weight ranges in anonymous memory backed by transparent huge pages.
//!
//! A memory-mapped checkpoint lives in the page cache in 4 KB pages. The kernels stream
//! weights front to back, and with 4 KB pages each page costs a TLB miss and restarts the
//! hardware prefetcher (it does not cross pages): on the 2-core EPYC VM one thread reads a
//! 256 MB buffer at 22-23 GB/s in 4 KB pages and at 29 GB/s in 2 MB pages. Page-cache pages
//! of an ordinary file cannot be asked to be huge, anonymous memory can (`madvise`), so the
//! matrices a process computes with are copied there once at load.

use std::collections::HashMap;
use std::sync::Arc;

use memmap2::MmapMut;

use super::{Backing, SharedBytes};
use crate::error::{Error, Result};

/// Where each copy starts: a cache line, as the kernels' wide loads like it.
const ALIGN: usize = 64;

/// Copies the bytes of every range in `ranges` that lies in a memory-mapped checkpoint file
/// into one block of anonymous memory that asks for transparent huge pages, and points the
/// range at its copy. Ranges over the same bytes share one copy; ranges of bytes made at load
/// time are left where they are. The copied pages of the file are then dropped from this
/// process's mappings (they stay in the page cache), so they no longer count in its resident
/// set twice. Returns the bytes copied.
///
/// Where the kernel does not grant huge pages (`transparent_hugepage` set to `never`, or
/// not Linux) the copy is made all the same, in ordinary pages.
pub fn move_to_huge_pages(ranges: &mut [&mut SharedBytes]) -> Result<usize> {
    let key = |b: &SharedBytes| (Arc::as_ptr(&b.backing) as usize, b.start, b.len);
    let mut at: HashMap<(usize, usize, usize), usize> = HashMap::new();
    let mut total = 0usize;
    for range in ranges.iter() {
        if matches!(*range.backing, Backing::Mapped(_)) && !range.is_empty() {
            at.entry(key(range)).or_insert_with(|| {
                let start = total.next_multiple_of(ALIGN);
                total = start + range.len;
                start
            });
        }
    }
    if total == 0 {
        return Ok(0);
    }
    let mut arena = MmapMut::map_anon(total).map_err(|source| Error::WeightMemory {
        bytes: total,
        source,
    })?;
    // Asked before the first write, so the pages are huge from the start. A refusal
    // (THP off) leaves ordinary pages, which still work.
    #[cfg(target_os = "linux")]
    let _ = arena.advise(memmap2::Advice::HugePage);
    let mut copied = vec![false; at.len()];
    let order: HashMap<usize, usize> = at.values().enumerate().map(|(i, &s)| (s, i)).collect();
    let mut bytes = 0;
    for range in ranges.iter() {
        if let Some(&start) = at.get(&key(range))
            && !std::mem::replace(&mut copied[order[&start]], true)
        {
            arena[start..start + range.len].copy_from_slice(range.as_bytes());
            range.release_pages(0, range.len);
            bytes += range.len;
        }
    }
    let arena = Arc::new(Backing::HugePages(arena.make_read_only().map_err(
        |source| Error::WeightMemory {
            bytes: total,
            source,
        },
    )?));
    for range in ranges.iter_mut() {
        if let Some(&start) = at.get(&key(range)) {
            **range = SharedBytes {
                backing: arena.clone(),
                start,
                len: range.len,
            };
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use memmap2::Mmap;

    use super::*;

    /// A mapped file of `len` bytes counting 0, 1, 2, ... (mod 251).
    fn mapped(len: usize) -> (tempfile::NamedTempFile, SharedBytes) {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        // SAFETY: the temporary file is not written while mapped.
        let map = unsafe { Mmap::map(file.as_file()) }.unwrap();
        let whole = SharedBytes {
            backing: Arc::new(Backing::Mapped(map)),
            start: 0,
            len,
        };
        (file, whole)
    }

    fn same_backing(a: &SharedBytes, b: &SharedBytes) -> bool {
        Arc::ptr_eq(&a.backing, &b.backing)
    }

    #[test]
    fn mapped_ranges_move_with_their_bytes_and_shared_ranges_share_one_copy() {
        let (_file, whole) = mapped(10_000);
        let (mut a, mut b, mut c) = (
            whole.slice(100, 3000),
            whole.slice(100, 3000),
            whole.slice(5, 7),
        );
        let mut owned = SharedBytes::from_vec(vec![9; 40]);
        let before: Vec<Vec<u8>> = [&a, &b, &c, &owned]
            .iter()
            .map(|r| r.as_bytes().to_vec())
            .collect();
        let owned_backing = owned.backing.clone();
        let moved = move_to_huge_pages(&mut [&mut a, &mut b, &mut c, &mut owned]).unwrap();
        // The two views of bytes 100..3100 are copied once; the bytes made in memory stay.
        assert_eq!(moved, 3000 + 7);
        let after: Vec<Vec<u8>> = [&a, &b, &c, &owned]
            .iter()
            .map(|r| r.as_bytes().to_vec())
            .collect();
        assert_eq!(before, after);
        assert!(matches!(*a.backing, Backing::HugePages(_)));
        assert!(same_backing(&a, &b) && same_backing(&a, &c));
        assert_eq!(a.as_bytes().as_ptr(), b.as_bytes().as_ptr());
        assert_ne!(a.as_bytes().as_ptr(), c.as_bytes().as_ptr());
        assert!(Arc::ptr_eq(&owned.backing, &owned_backing));
        for r in [&a, &c] {
            assert_eq!(r.as_bytes().as_ptr() as usize % ALIGN, 0);
        }
        // The file's pages were released from this process, not lost: they read back the same.
        assert_eq!(whole.slice(100, 3000).as_bytes(), &before[0][..]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn copied_and_released_pages_leave_the_page_tables_but_read_the_same() {
        use crate::test_support::mapped_pages;
        use crate::weights::{WeightFormat, WeightMatrix};
        let (_file, whole) = mapped(64 << 10);
        let expected = whole.as_bytes().to_vec();
        assert_eq!(
            mapped_pages(whole.as_bytes()),
            (16, 16),
            "read once, every page is mapped in"
        );
        // A bf16 matrix of 64 rows of 1 KB, and a view of its odd rows (as GPT-OSS's gate and
        // up interleave theirs). Its rows 4..28 are stored rows 9..=55: bytes 9 KB..56 KB,
        // released in whole pages from 8 KB (the page holding the first byte) to 56 KB.
        let m = WeightMatrix::from_bytes(WeightFormat::Bf16, 64, 512, whole.clone());
        let odd = m.select_rows(1, 2, 32);
        odd.release_rows(4, 24);
        let inside = whole.slice(12 << 10, 44 << 10);
        assert_eq!(mapped_pages(inside.as_bytes()), (11, 0));
        assert_eq!(mapped_pages(whole.slice(0, 8 << 10).as_bytes()), (2, 2));
        assert_eq!(
            mapped_pages(whole.slice(56 << 10, 8 << 10).as_bytes()),
            (2, 2)
        );
        assert_eq!(whole.as_bytes(), &expected[..]);
        // Moving into huge pages drops the copied range too.
        let mut range = whole.slice(0, 64 << 10);
        move_to_huge_pages(&mut [&mut range]).unwrap();
        assert_eq!(range.as_bytes(), &expected[..]);
        let fresh = whole.slice(0, 64 << 10);
        assert_eq!(mapped_pages(fresh.as_bytes()), (16, 0));
    }

    #[test]
    fn nothing_mapped_moves_nothing() {
        let mut owned = SharedBytes::from_vec(vec![1, 2, 3]);
        let backing = owned.backing.clone();
        assert_eq!(move_to_huge_pages(&mut [&mut owned]).unwrap(), 0);
        assert_eq!(move_to_huge_pages(&mut []).unwrap(), 0);
        assert!(Arc::ptr_eq(&owned.backing, &backing));
    }
}
