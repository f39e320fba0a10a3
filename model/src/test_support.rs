//! Test support shared by the workspace's test suites: where the committed transformers
//! fixtures are. Nothing at run time uses it.

use std::path::{Path, PathBuf};

/// The repository's `fixtures/` folder.
pub fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// Every committed fixture checkpoint (the folders of [`fixtures_root`] holding a transformers
/// `expected.json`), sorted.
pub fn fixture_dirs() -> std::io::Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(fixtures_root())? {
        let path = entry?.path();
        if path.join("expected.json").exists() {
            dirs.push(path);
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// Of the whole 4 KB pages inside `bytes`, how many there are and how many this process has
/// mapped in (`/proc/self/pagemap`'s present bit), so tests can see a loader drop the pages
/// it has copied. Linux only; panics if the pagemap cannot be read, so a test relying on it
/// fails rather than passing without looking.
#[cfg(target_os = "linux")]
pub fn mapped_pages(bytes: &[u8]) -> (usize, usize) {
    use std::os::unix::fs::FileExt;
    const PAGE: usize = 4096;
    let start = (bytes.as_ptr() as usize).next_multiple_of(PAGE);
    let end = (bytes.as_ptr() as usize + bytes.len()) / PAGE * PAGE;
    let pages = end.saturating_sub(start) / PAGE;
    let map = std::fs::File::open("/proc/self/pagemap").expect("open /proc/self/pagemap");
    let mut entries = vec![0u8; pages * 8];
    map.read_exact_at(&mut entries, (start / PAGE * 8) as u64)
        .expect("read /proc/self/pagemap");
    let present = entries
        .chunks_exact(8)
        .filter(|e| e[7] & 0x80 != 0) // bit 63 of a little-endian entry: page present
        .count();
    (pages, present)
}
