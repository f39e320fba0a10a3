# Source this (bash): the CUDA toolchain for `--features cuda` builds, from PyPI's CUDA wheels,
# on a machine with no GPU and no driver. Installs the pinned wheels into a venv (once) and
# exports PATH (nvcc), CUDA_ROOT and CUDA_COMPUTE_CAP. With AFD_CUDA_LINK=1 it also installs the
# libraries a full link needs (cuBLAS, cuRAND, NVRTC) and makes a link-time stand-in for the
# driver's libcuda.so.1 (the driver itself, on the machine that runs the binary, is the real one),
# and exports LIBRARY_PATH for them.
#
#   source scripts/cuda_env.sh                    # nvcc for cargo check / clippy --features cuda
#   AFD_CUDA_LINK=1 source scripts/cuda_env.sh    # ... and for cargo build --release --features cuda
#
# Variables: CUDA_VENV (default target/cuda-venv), CUDA_COMPUTE_CAP (default 90: H100, H200),
# PYTHON (default python3).
#
# The versions are pinned to CUDA 13.0: the GPU machines this project is checked on run driver
# 580 (CUDA 13.0), which refuses PTX written by a newer nvcc, and cudarc 0.19.10 accepts 13.0 to
# 13.4 only ("Unsupported cuda toolkit version" for 13.5). nvcc, nvvm and ptxas must be the same
# release (an nvvm newer than ptxas writes PTX that ptxas rejects).

_afd_cuda_env() {
    local venv="${CUDA_VENV:-target/cuda-venv}"
    local python="${PYTHON:-python3}"
    local compiler=(
        "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88"
        "nvidia-cuda-runtime==13.0.88" "nvidia-cuda-cccl==13.0.85"
    )
    local libraries=(
        "nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.0.35" "nvidia-cuda-nvrtc==13.0.88"
    )
    local wanted=("${compiler[@]}")
    if [ "${AFD_CUDA_LINK:-0}" = 1 ]; then
        wanted+=("${libraries[@]}")
    fi
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv "$venv" || {
            echo "cuda_env: cannot make a Python venv at $venv (is python3-venv installed?)" >&2
            return 1
        }
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${wanted[@]}" || {
        echo "cuda_env: cannot install ${wanted[*]} from PyPI into $venv" >&2
        return 1
    }
    local root
    root="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')" || return 1
    if [ ! -x "$root/bin/nvcc" ]; then
        echo "cuda_env: no nvcc in $root after installing the wheels" >&2
        return 1
    fi
    export CUDA_ROOT="$root"
    export CUDA_PATH="$root"
    export PATH="$root/bin:$PATH"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    if [ "${AFD_CUDA_LINK:-0}" = 1 ]; then
        # The wheels ship versioned sonames only; the linker's -lNAME wants libNAME.so.
        local stubs="$venv/link"
        mkdir -p "$stubs"
        local lib
        for lib in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13 cudart.so.13; do
            ln -sf "$root/lib/lib$lib" "$stubs/lib${lib%%.so*}.so"
        done
        if [ ! -e "$stubs/libcuda.so" ]; then
            # libcuda.so.1 belongs to the driver, which this machine need not have: a stand-in
            # with the soname and every cu* symbol of cuda.h, for the link only.
            "${CC:-cc}" -E -P -I "$root/include" "$root/include/cuda.h" \
                | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' (' | sort -u \
                | sed 's/.*/void &(void) {}/' >"$stubs/libcuda-stub.c" &&
                "${CC:-cc}" -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" \
                    "$stubs/libcuda-stub.c" || {
                echo "cuda_env: cannot build the link-time libcuda stand-in (needs a C compiler)" >&2
                return 1
            }
        fi
        export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
    fi
    echo "cuda_env: $("$root/bin/nvcc" --version | tail -2 | head -1) at $root, compute capability $CUDA_COMPUTE_CAP"
}

_afd_cuda_env
