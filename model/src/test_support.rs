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
