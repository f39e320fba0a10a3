#!/usr/bin/env bash
# llama.cpp as a benchmark peer of afd: builds llama-server and llama-bench from source and
# converts a Hugging Face checkpoint (e.g. one of `afd synth`) to GGUF. Used by
# `scripts/bench_suite.sh --with-llamacpp`; not part of CI.
#
#   scripts/bench_llamacpp.sh [OPTIONS] [--model DIR [--gguf FILE]]
#
# The source comes from PyPI at benchmark time: the llama-cpp-python source distribution
# carries llama.cpp in vendor/llama.cpp, with convert_hf_to_gguf.py and gguf-py. Nothing of it
# enters the repository; everything lands in the cache folder:
#   DIR/src/          the unpacked llama.cpp source (with convert_hf_to_gguf.py, gguf-py)
#   DIR/build/bin/    llama-server, llama-bench (CPU only, -march=native, Release)
#   DIR/venv/         a Python with what convert_hf_to_gguf.py needs (torch, transformers, ...),
#                     made at the first conversion; it may be deleted to save disk
#   DIR/cmake/        cmake from PyPI, when there is none on PATH
#   DIR/gguf/         converted checkpoints (unless --gguf names the file)
#   DIR/built.txt     what was built: the llama-cpp-python version, llama.cpp's build
# Later runs reuse all of it; a checkpoint is converted again only when its files changed.
# On stdout, one KEY=VALUE a line: LLAMACPP_SERVER, LLAMACPP_BENCH, LLAMACPP_VERSION, and
# with --model, LLAMACPP_GGUF. Progress goes to stderr.
#
# --model: bf16 GGUF (`--outtype bf16`); MXFP4 experts (GPT-OSS `*_blocks`/`*_scales`) stay
# MXFP4, as the converter repacks them. afd synth's tokenizer is a byte-level BPE (the 256
# bytes, GPT-2's ByteLevel split, specials, no merges) that the converter does not know, so
# it is run with two minimal workarounds, each applied only when needed:
#   - an unrecognized BPE pre-tokenizer hash is taken as "gpt-2", the split afd synth's
#     tokenizer.json declares (ByteLevel with GPT-2's regex);
#   - a tokenizer without merges gets one placeholder merge of two multi-character strings,
#     which never applies (BPE symbols start as single characters), because GGUF cannot hold
#     an empty list and llama.cpp's BPE needs the merges key.
# Tokenization is then the same bytes in both; the benchmarks send token ids anyway.
#
# Options (each also as an environment variable, in brackets):
#   --cache DIR    [LLAMACPP_CACHE=<cargo target folder>/llamacpp]
#   --version V    the llama-cpp-python release on PyPI [LLAMACPP_VERSION=0.3.36]
#   --jobs N       parallel compile jobs [LLAMACPP_JOBS=$(nproc)]
#   --python PATH  the Python to make the venv from [LLAMACPP_PYTHON=python3]
#   --model DIR    a Hugging Face checkpoint folder to convert
#   --gguf FILE    where to write its GGUF [DIR/gguf/<folder name>-bf16.gguf]
# cmake comes from PATH, else from PyPI into the venv.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${LLAMACPP_CACHE:-${CARGO_TARGET_DIR:-$repo/target}/llamacpp}"
version="${LLAMACPP_VERSION:-0.3.36}"
jobs="${LLAMACPP_JOBS:-$(nproc)}"
python="${LLAMACPP_PYTHON:-python3}"
model=""
gguf=""

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() { echo "bench_llamacpp: $*" >&2; exit 1; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cache) need_value "$@"; cache="$2"; shift 2 ;;
        --version) need_value "$@"; version="$2"; shift 2 ;;
        --jobs) need_value "$@"; jobs="$2"; shift 2 ;;
        --python) need_value "$@"; python="$2"; shift 2 ;;
        --model) need_value "$@"; model="$2"; shift 2 ;;
        --gguf) need_value "$@"; gguf="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
log() { echo "[bench_llamacpp $(date -u +%H:%M:%S)] $*" >&2; }
[[ -z "$gguf" || -n "$model" ]] || die "--gguf needs --model"
[[ -z "$model" || -f "$model/config.json" ]] || die "no config.json in --model $model: pass a Hugging Face checkpoint folder"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
built="$cache/built.txt"
server="$cache/build/bin/llama-server"
bench="$cache/build/bin/llama-bench"

# The converter's Python, made when a conversion needs it (and again if it was deleted to
# save disk: torch with its CUDA libraries takes about 6 GB).
converter_python() {
    if [[ ! -x "$cache/venv/bin/python" ]] || ! "$cache/venv/bin/python" -c 'import torch, transformers, numpy, sentencepiece, yaml, tqdm' 2>/dev/null; then
        log "making $cache/venv with the converter's packages (torch is large: a few minutes)"
        "$python" -m venv "$cache/venv" || die "$python -m venv failed (on Debian: apt-get install python3-venv)"
        "$cache/venv/bin/python" -m pip install --quiet --upgrade pip
        # The converter's requirements (src/requirements/requirements-convert_*.txt) without the
        # PyTorch CPU index, which is not a package registry: torch comes from PyPI.
        "$cache/venv/bin/python" -m pip install --quiet "numpy>=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
            "transformers==4.57.6" "protobuf>=4.21.0,<5.0.0" torch safetensors tqdm pyyaml requests \
            || die "could not install the converter's Python packages into $cache/venv"
    fi
}

# --- build ----------------------------------------------------------------------------------
build() {
    # The source: only llama-cpp-python itself as source, since `--no-binary :all:` would also
    # compile its build backend's dependencies (cmake among them) just to read its metadata.
    if [[ ! -f "$cache/src/convert_hf_to_gguf.py" ]] || ! grep -qx "source $version" "$cache/src.version" 2>/dev/null; then
        log "downloading llama-cpp-python $version (source distribution) from PyPI"
        rm -rf "$cache/sdist" "$cache/src"
        mkdir -p "$cache/sdist"
        "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$version" -d "$cache/sdist" \
            || die "pip could not download llama-cpp-python==$version (is PyPI reachable? is the version right?)"
        tarball="$(ls "$cache"/sdist/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)"
        [[ -n "$tarball" ]] || die "pip downloaded no source distribution into $cache/sdist"
        tar -xzf "$tarball" -C "$cache/sdist"
        vendored="$(ls -d "$cache"/sdist/llama_cpp_python-*/vendor/llama.cpp | head -1)"
        [[ -f "$vendored/convert_hf_to_gguf.py" ]] || die "$tarball carries no vendor/llama.cpp/convert_hf_to_gguf.py"
        mv "$vendored" "$cache/src"
        rm -rf "$cache/sdist"
        echo "source $version" >"$cache/src.version"
    fi

    # llama-server and llama-bench.
    cmake_bin="$(command -v cmake || true)"
    if [[ -z "$cmake_bin" ]]; then
        if [[ ! -x "$cache/cmake/bin/cmake" ]]; then
            log "no cmake on PATH: installing it from PyPI into $cache/cmake"
            "$python" -m venv "$cache/cmake" && "$cache/cmake/bin/python" -m pip install --quiet cmake \
                || die "no cmake on PATH and pip could not install it"
        fi
        cmake_bin="$cache/cmake/bin/cmake"
    fi
    log "configuring llama.cpp with $cmake_bin"
    # CPU only, tuned for this machine as a user building it would; no downloads at build time
    # (the web UI would be fetched from a hub), no HTTPS (loopback only), no tests or examples.
    "$cmake_bin" -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
        >"$cache/configure.log" 2>&1 || { tail -30 "$cache/configure.log" >&2; die "cmake configure failed; see $cache/configure.log"; }
    log "building llama-server and llama-bench with $jobs jobs (tens of minutes on 2 cores)"
    "$cmake_bin" --build "$cache/build" --target llama-server llama-bench -j "$jobs" \
        >"$cache/build.log" 2>&1 || { tail -30 "$cache/build.log" >&2; die "the llama.cpp build failed; see $cache/build.log"; }
    [[ -x "$server" && -x "$bench" ]] || die "the build made no $server or $bench"
    {
        echo "llama-cpp-python $version"
        "$server" --version 2>&1 | grep -i -E 'version|built' | head -2
    } >"$built"
    log "built: $(tr '\n' ' ' <"$built")"
}

if [[ -x "$server" && -x "$bench" ]] \
    && grep -qx "llama-cpp-python $version" "$built" 2>/dev/null; then
    log "llama.cpp from llama-cpp-python $version is built in $cache"
else
    build
fi

# --- conversion -----------------------------------------------------------------------------
if [[ -n "$model" ]]; then
    model="$(cd "$model" && pwd)"
    gguf="${gguf:-$cache/gguf/$(basename "$model")-bf16.gguf}"
    mkdir -p "$(dirname "$gguf")"
    # What the GGUF was made from: the converter's version and the checkpoint's files.
    stamp="llama-cpp-python $version; $(cd "$model" && stat -c '%n %s %Y' -- *.json *.safetensors 2>/dev/null | tr '\n' ';')"
    if [[ -f "$gguf" ]] && [[ "$(cat "$gguf.stamp" 2>/dev/null)" == "$stamp" ]]; then
        log "$gguf is up to date"
    else
        converter_python
        log "converting $model to $gguf (bf16; MXFP4 experts stay MXFP4)"
        rm -f "$gguf" "$gguf.stamp"
        "$cache/venv/bin/python" - "$cache/src" "$model" --outtype bf16 --outfile "$gguf" \
            >"$gguf.log" 2>&1 <<'PY' || { tail -30 "$gguf.log" >&2; die "the conversion failed; see $gguf.log"; }
import logging, runpy, sys
from pathlib import Path

src = Path(sys.argv[1])
sys.path[:0] = [str(src), str(src / "gguf-py")]
import gguf  # noqa: E402  (the source's own gguf-py, as the converter would import it)
import conversion.base as base  # noqa: E402

log = logging.getLogger("bench_llamacpp")
recognized_pre = base.TextModel.get_vocab_base_pre


def pre_or_gpt2(self, tokenizer):
    try:
        return recognized_pre(self, tokenizer)
    except NotImplementedError:
        log.warning("bench_llamacpp: pre-tokenizer not recognized; using 'gpt-2' (afd synth's "
                    "tokenizer.json splits with ByteLevel and GPT-2's regex)")
        return "gpt-2"


# Two multi-character halves: BPE symbols start as single characters, so it never applies.
PLACEHOLDER_MERGE = "<no-merges> <no-merges>"
add_special_vocab = gguf.SpecialVocab.add_to_gguf


def add_with_a_merge(self, gw, quiet=False):
    if self.load_merges and not self.merges:
        log.warning("bench_llamacpp: the tokenizer has no merges; writing one that never applies")
        self.merges = [PLACEHOLDER_MERGE]
    return add_special_vocab(self, gw, quiet)


base.TextModel.get_vocab_base_pre = pre_or_gpt2
gguf.SpecialVocab.add_to_gguf = add_with_a_merge
sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
        [[ -s "$gguf" ]] || die "the converter wrote no $gguf; see $gguf.log"
        echo "$stamp" >"$gguf.stamp"
        log "wrote $gguf ($(du -h "$gguf" | cut -f1))"
    fi
fi

echo "LLAMACPP_SERVER=$server"
echo "LLAMACPP_BENCH=$bench"
echo "LLAMACPP_VERSION=$(tr '\n' ' ' <"$built" | sed 's/ *$//')"
if [[ -n "$model" ]]; then echo "LLAMACPP_GGUF=$gguf"; fi
