//! With the `cuda` feature, compiles `kernels/*.cu` to PTX with nvcc (found on the PATH, or
//! under `CUDA_ROOT`/`CUDA_PATH`/`CUDA_HOME`), for the compute capability in `CUDA_COMPUTE_CAP`
//! (default 90: H100 and H200). Without the feature it does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    for var in ["CUDA_COMPUTE_CAP", "CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = nvcc();
    let source = PathBuf::from("kernels/afd.cu");
    let ptx = out.join("afd.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg(&source)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} to build the CUDA kernels ({e}): install the CUDA toolkit (or \
                 PyPI's nvidia-cuda-nvcc) and put nvcc on the PATH or set CUDA_ROOT",
                nvcc.display()
            )
        });
    assert!(
        status.success(),
        "nvcc failed on {} ({status})",
        source.display()
    );
}

/// nvcc from the CUDA root variables, else the PATH.
fn nvcc() -> PathBuf {
    for var in ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            let candidate = PathBuf::from(root).join("bin").join("nvcc");
            if candidate.exists() {
                return candidate;
            }
        }
    }
    PathBuf::from("nvcc")
}
