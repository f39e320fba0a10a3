//! How a test that cannot run on this machine says so, where CI counts it (a dev-dependency
//! of the crates whose tests need a CPU feature, several CPUs, root or a tool).
//!
//! Stable Rust's test harness cannot mark a test ignored once it has started, so a test that
//! finds the machine lacking returns early and reports ok. [`skipped`] makes that visible:
//! it prints why on stderr (shown with `--nocapture`) and, where `AFD_TEST_SKIPS` names a
//! file, appends one line to it, which `.ci/run` counts and prints after the tests.
//!
//! It owns nothing else: no test logic, no detection of what the machine has.
//!
//! Must not: depend on any crate, or be anything but a dev-dependency.

use std::io::Write;

/// The environment variable naming the file skips are appended to.
pub const SKIPS_FILE_VAR: &str = "AFD_TEST_SKIPS";

/// Records that the calling test did not run (or ran in part) here because of `why`; the
/// caller then returns. `why` should say what the machine lacks and where the test does run.
/// The test is named by its thread, which the test harness names after the test.
pub fn skipped(why: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("{line}");
    let Some(path) = std::env::var_os(SKIPS_FILE_VAR) else {
        return;
    };
    // One short write with O_APPEND: lines from tests running in parallel do not interleave.
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        eprintln!(
            "cannot record the skip in {} ({SKIPS_FILE_VAR}): {e}",
            std::path::Path::new(&path).display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_appended_to_the_named_file() {
        let dir = std::env::temp_dir().join(format!("test-skips-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("skips.txt");
        // SAFETY: this crate's only test that reads or writes the environment.
        unsafe { std::env::set_var(SKIPS_FILE_VAR, &file) };
        skipped("no AVX-512 here");
        std::thread::Builder::new()
            .name("second_test".into())
            .spawn(|| skipped("one CPU"))
            .unwrap()
            .join()
            .unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        assert_eq!(
            text,
            "SKIPPED tests::a_skip_is_appended_to_the_named_file: no AVX-512 here\n\
             SKIPPED second_test: one CPU\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
