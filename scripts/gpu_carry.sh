#!/usr/bin/env bash
# Builds the GPU check's binaries with `--features cuda` on a machine without a GPU (nvcc and
# the CUDA libraries from PyPI's wheels, scripts/cuda_env.sh) and puts them, stripped and
# xz-compressed (about 10 MB each; the device machines take 64 MiB with the repository), in
# .gpu-carry/ for scripts/gpu_check.sh on a GPU machine that has no Rust toolchain.
#
#   scripts/gpu_carry.sh        # then carry .gpu-carry/ (with the repository) to the GPU machine
#
# The binaries need glibc 2.36 or newer and, at run time, the NVIDIA driver's libcuda.so.1 and
# the CUDA 13 libraries cuBLAS, cuRAND, NVRTC and the runtime (gpu_check.sh finds them in a CUDA
# toolkit or in PyTorch's nvidia wheels). Variables: CUDA_COMPUTE_CAP (default 90),
# CARGO_TARGET_DIR (default target/cuda, away from the default build's artifacts).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=cuda_env.sh
AFD_CUDA_LINK=1 source scripts/cuda_env.sh
target="${CARGO_TARGET_DIR:-target/cuda}"
cargo build --release --features cuda -p deploy --bin afd --example gpu_check --target-dir "$target"
mkdir -p .gpu-carry
for b in "$target/release/afd" "$target/release/examples/gpu_check"; do
    name="$(basename "$b")"
    strip -o ".gpu-carry/$name" "$b"
    xz -T0 -9 -f ".gpu-carry/$name"
done
{
    echo "built $(date -u +%Y-%m-%dT%H:%MZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"
    echo "$(nvcc --version | tail -2 | head -1), compute capability $CUDA_COMPUTE_CAP"
} >.gpu-carry/BUILT
ls -l .gpu-carry/
cat .gpu-carry/BUILT
