#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, the attention node's device path (`--device
# cuda`) against the transformers fixtures, then its speed on a GPT-OSS-20B-shaped checkpoint
# beside `afd plan`'s prediction for the GPU's profile (h100 or h200). One command; it prints
# what it runs and every figure, and keeps a log.
#
#   scripts/gpu_check.sh [OUT_DIR]            # default target/gpu-check
#
# Binaries: `.gpu-carry/afd.xz` and `.gpu-carry/gpu_check.xz` when present (a release build
# made elsewhere with scripts/gpu_carry.sh and carried over; unpacked into OUT_DIR/bin), else
# built here with `cargo build --release --features cuda` (needs cargo and nvcc).
#
# (a) `afd verify --device cuda --require-exact` on every fixture with 1-4 cards (the CLI path
#     against the reference forward), then the gpu_check program: each linear kernel against its
#     CPU twin at awkward shapes (partial tiles, features past a lane stride), every fixture's
#     prompts through the cards with attention on the GPU (tokens equal transformers', step logits
#     within 1e-4), and the GPU-only baseline's tokens.
# (b) `afd synth --preset gpt-oss-20b` (MXFP4 experts, kept on the simulated cards' host), then
#     the attention node's time per layer and per decode step at batch 1, 32 and 64 and 1K context,
#     and the GPU-only baseline's TPOT at batch 1, each beside the planner's prediction.
#
# Variables: GPU_CHECK_CARDS (card counts, default "1 2 3 4"), GPU_CHECK_BATCHES (default
# 1,32,64), GPU_CHECK_CONTEXT (default 1024), GPU_CHECK_STEPS (default 8), GPU_CHECK_SKIP_BENCH=1,
# CUDA_DEVICE (default cuda, i.e. cuda:0).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/gpu-check}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
started=$SECONDS
say() { echo "[gpu_check +$((SECONDS - started))s] $*"; }
run() {
    say "\$ $*"
    "$@"
}

DEVICE="${CUDA_DEVICE:-cuda}"
CARDS="${GPU_CHECK_CARDS:-1 2 3 4}"
BATCHES="${GPU_CHECK_BATCHES:-1,32,64}"
CONTEXT="${GPU_CHECK_CONTEXT:-1024}"
STEPS="${GPU_CHECK_STEPS:-8}"

# -- the GPU
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or lists none)" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
case "$GPU_NAME" in
    *H200*) PROFILE=h200 ;;
    *) PROFILE=h100 ;;
esac
say "GPU: $GPU_NAME (compute capability $CAP), planner profile $PROFILE"

# -- the CUDA libraries the binary links (libcuda from the driver; cuBLAS, cuRAND, NVRTC and
# the runtime from a CUDA toolkit or from PyTorch's / PyPI's nvidia wheels)
lib_dirs=()
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
    /usr/lib/x86_64-linux-gnu /usr/lib64; do
    [ -d "$d" ] && lib_dirs+=("$d")
done
for py in python3 /opt/torch/.venv/bin/python3 /opt/torch/.venv/bin/python; do
    command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
    while IFS= read -r d; do
        [ -n "$d" ] && lib_dirs+=("$d")
    done < <("$py" - <<'EOF' 2>/dev/null || true
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
for r in sorted(p for p in roots if p and os.path.isdir(p)):
    for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")) + glob.glob(os.path.join(r, "torch", "lib")):
        print(d)
EOF
    )
done
find_lib() {
    local d
    for d in "${lib_dirs[@]}"; do
        if [ -e "$d/$1" ]; then
            echo "$d"
            return 0
        fi
    done
    return 1
}
ld_path=""
for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13; do
    if dir="$(find_lib "$lib")"; then
        say "$lib in $dir"
        case ":$ld_path:" in *":$dir:"*) ;; *) ld_path="${ld_path:+$ld_path:}$dir" ;; esac
    else
        say "WARNING: $lib not found in ${lib_dirs[*]}"
    fi
done
export LD_LIBRARY_PATH="${ld_path}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# -- the binaries
unpack() {
    # xz where it is installed, else Python's lzma.
    if command -v xz >/dev/null; then
        xz -dc "$1" >"$2"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
    fi
    chmod +x "$2"
}
if [ -e .gpu-carry/afd.xz ] && [ -e .gpu-carry/gpu_check.xz ]; then
    mkdir -p "$OUT/bin"
    unpack .gpu-carry/afd.xz "$OUT/bin/afd"
    unpack .gpu-carry/gpu_check.xz "$OUT/bin/gpu_check"
    AFD="$OUT/bin/afd"
    CHECK="$OUT/bin/gpu_check"
    say "using the carried binaries from .gpu-carry/ ($(tr '\n' ' ' <.gpu-carry/BUILT 2>/dev/null || echo 'no build note'))"
elif [ -x .gpu-carry/afd ] && [ -x .gpu-carry/gpu_check ]; then
    AFD=.gpu-carry/afd
    CHECK=.gpu-carry/gpu_check
    say "using the carried binaries in .gpu-carry/ ($(tr '\n' ' ' <.gpu-carry/BUILT 2>/dev/null || echo 'no build note'))"
elif command -v cargo >/dev/null; then
    if ! command -v nvcc >/dev/null; then
        # shellcheck source=cuda_env.sh
        CUDA_COMPUTE_CAP="$CAP" AFD_CUDA_LINK=1 source scripts/cuda_env.sh
    fi
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$CAP}"
    run cargo build --release --features cuda -p deploy --bin afd --example gpu_check
    AFD=target/release/afd
    CHECK=target/release/examples/gpu_check
else
    echo "gpu_check: no carried binaries in .gpu-carry/ and no cargo to build them; make them on a" \
        "build machine with scripts/gpu_carry.sh and carry .gpu-carry/ over" >&2
    exit 1
fi
for b in "$AFD" "$CHECK"; do
    if ldd "$b" | grep -q "not found"; then
        ldd "$b" | grep "not found" >&2
        echo "gpu_check: $b misses the libraries above; put them on LD_LIBRARY_PATH" >&2
        exit 1
    fi
done

failed=0
# -- (a) the fixtures
say "(a) afd verify --device $DEVICE --require-exact on every fixture, cards: $CARDS"
for f in fixtures/*/; do
    [ -e "$f/expected.json" ] || continue
    for c in $CARDS; do
        if ! run "$AFD" verify --model "$f" --cards "$c" --device "$DEVICE" --transport inproc \
            --prompts 4 --max-tokens 12 --require-exact; then
            failed=$((failed + 1))
        fi
    done
done
cards_csv="$(echo "$CARDS" | tr ' ' ',')"
if ! run "$CHECK" --device "$DEVICE" --fixtures fixtures --cards "$cards_csv" \
    --deployments deploy/deployments; then
    failed=$((failed + 1))
fi

# -- (b) speed against the planner
if [ "${GPU_CHECK_SKIP_BENCH:-0}" != 1 ]; then
    CKPT="$OUT/gpt-oss-20b"
    if [ ! -e "$CKPT/config.json" ]; then
        run "$AFD" synth --family gpt-oss --preset gpt-oss-20b --format mxfp4 --out "$CKPT"
    fi
    if ! run "$CHECK" --device "$DEVICE" --no-fixtures --no-kernels --checkpoint "$CKPT" --profile "$PROFILE" \
        --batches "$BATCHES" --context "$CONTEXT" --steps "$STEPS" --deployments deploy/deployments; then
        failed=$((failed + 1))
    fi
fi

say "done in $((SECONDS - started)) s; log in $LOG"
if [ "$failed" -gt 0 ]; then
    say "$failed check(s) FAILED"
    exit 1
fi
say "every check passed"
