#!/usr/bin/env bash
# afd's benchmark suite: one synthetic checkpoint, the standard deployments side by side.
#
#   scripts/bench_suite.sh [OPTIONS] [OUT_DIR]
#
# Builds `afd` and `afd-loadtest` in release once, makes a synthetic checkpoint with `afd synth`
# (cached under the cargo target folder), then for each round and each variant starts
# `afd serve` on loopback, waits for /health, runs `afd-loadtest` at every concurrency with fixed
# input/output lengths and --ignore-eos, saves /metrics (the cards' modeled time) and stops the
# server. The variant order rotates every round, so slow drifts of a shared machine fall on every
# variant alike. At the end `afd-loadtest compare` writes the tables and plots:
#
#   OUT_DIR/comparison.md    every variant against monolithic (ratios side by side)
#   OUT_DIR/overlap/...      2 cards, overlap on (2 micro-batches) against off (1)
#   OUT_DIR/modeled.md       the cards' modeled (Corsair performance model) time per step
#   OUT_DIR/rss.md           each server's peak resident memory (VmHWM), median over rounds
#   OUT_DIR/*.svg (+ .png)   TPOT, TTFT and throughput against concurrency, one line per variant
#   OUT_DIR/machine.txt      CPU, cores, memory, load, commit
#   OUT_DIR/runs/, hf/, logs/, metrics/, rss/: the raw results
#
# Variants: monolithic (afd serve --reference), afd with 1, 2 and 4 cards (2 micro-batches, the
# overlap), afd with 2 cards and 1 micro-batch (no overlap), and Hugging Face transformers
# `generate` (scripts/hf_generate_bench.py) when its Python has torch and transformers.
# `afd-8cards` (8 cards, 2 micro-batches) runs only when --variants names it, as do the
# `-bf16` twins of monolithic, afd-2cards, afd-2cards-no-overlap and afd-8cards (`--activation-dtype bf16`: activations
# rounded to bf16 where they meet bf16 or MXFP4 weights, the numerics of a bf16 GGUF in llama.cpp)
# and the `-auto` ones (afd-2cards-auto, afd-2cards-bf16-auto, afd-8cards-bf16-auto,
# afd-8cards-mxint8-auto: afd serve's
# default `--micro-batches auto`, which measures one and two micro-batches and runs the faster),
# and `afd-2cards-bf16-replicated` (the -auto one with `--replicate-experts`: both cards hold
# every expert, and each step spreads its experts evenly over them; afd's default
# `--replicate-experts auto` does so where the copies fit), `afd-2cards-one-copy` and
# `afd-2cards-bf16-one-copy` (the -auto ones with `--replicate-experts false`: each expert on
# one card), `afd-2cards-inproc` and `afd-2cards-bf16-inproc`
# (the -auto ones over the in-process transport instead of loopback QUIC: what the data plane's
# packets and wake-ups cost a step), and the `-mxint8` twins of monolithic, afd-2cards and
# afd-8cards (`--activation-dtype mxint8`: MXFP4 experts take MXINT8 inputs and integer block
# sums, as llama.cpp's MXFP4 path takes 8-bit ones; bf16 weights as with bf16), and the `-ct2`
# twins of afd-2cards-auto, afd-2cards-bf16-auto and afd-8cards-mxint8-auto (`--card-threads 2`:
# each card's executor on two threads), and `afd-2cards-no-prefix-caching` (the -auto one with
# `--no-enable-prefix-caching`; with --prefix-len, what prefix caching saves).
# With --with-llamacpp, llama.cpp's llama-server is a variant too (`llama-server`), built from
# source and fed a GGUF converted from the same checkpoint by scripts/bench_llamacpp.sh (both
# cached under the cargo target folder), served with `-t THREADS -np <largest concurrency> -kvu
# --no-cache-prompt -c <context>` and measured by afd-loadtest exactly like afd; it is then the
# baseline of the comparison. `llama-server-hugepages` is the same server reading the GGUF into
# buffers in transparent huge pages (`-lm none`, GLIBC_TUNABLES=glibc.malloc.hugetlb=1), as
# afd holds its weights: the peer at its best on a kernel whose THP is `madvise`.
#
# Options (each also as an environment variable, in brackets):
#   --family F          checkpoint family for afd synth [BENCH_FAMILY=mixtral]
#   --preset P          afd synth preset [BENCH_PRESET=medium]
#   --model DIR         use this checkpoint instead of a synthetic one [BENCH_MODEL]
#   --rounds N          repeats of every variant, interleaved [BENCH_ROUNDS=3]
#   --concurrency LIST  concurrencies to measure [BENCH_CONCURRENCY=1,4,16]
#   --prompts-per-slot K  requests per run = K x concurrency, at least 4 [BENCH_PROMPTS_PER_SLOT=2]
#   --input-len N       prompt tokens [BENCH_INPUT_LEN=64]
#   --prefix-len N      tokens of one prefix every prompt starts with, before its own
#                       --input-len (a shared system prompt; afd-loadtest --prefix-len)
#                       [BENCH_PREFIX_LEN=0]
#   --output-len N      output tokens [BENCH_OUTPUT_LEN=32]
#   --variants LIST     a subset, e.g. monolithic,afd-2cards [BENCH_VARIANTS=all]
#   --with-hf | --no-hf force or skip the transformers peer [BENCH_HF=auto]
#   --hf-python PATH    Python with torch + transformers [HF_PYTHON=python3]
#   --with-llamacpp     add llama.cpp's llama-server as a variant [BENCH_LLAMACPP=off]
#   --llamacpp-threads N  llama-server -t [BENCH_LLAMACPP_THREADS=$(nproc)]
#   --llamacpp-ctx N    llama-server -c, the KV cache's tokens shared by all slots
#                       [BENCH_LLAMACPP_CTX=4096]
#   --llamacpp-gguf FILE  where the converted checkpoint goes [BENCH_LLAMACPP_GGUF: in the cache]
#   --llamacpp-args "..." extra flags for llama-server [BENCH_LLAMACPP_ARGS]
#   --baseline NAME     the variant the ratios are against [BENCH_BASELINE: llama-server when it
#                       ran, else the first variant]
#   --port P            port for afd serve [BENCH_PORT=18731]
#   --serve-args "..."  extra flags for every afd serve [BENCH_SERVE_ARGS]
# BENCH_COMMIT names the commit in machine.txt when the source is not a git checkout;
# LLAMACPP_CACHE and LLAMACPP_VERSION are passed on to scripts/bench_llamacpp.sh.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
family="${BENCH_FAMILY:-mixtral}"
preset="${BENCH_PRESET:-medium}"
model="${BENCH_MODEL:-}"
rounds="${BENCH_ROUNDS:-3}"
concurrency="${BENCH_CONCURRENCY:-1,4,16}"
prompts_per_slot="${BENCH_PROMPTS_PER_SLOT:-2}"
input_len="${BENCH_INPUT_LEN:-64}"
prefix_len="${BENCH_PREFIX_LEN:-0}"
output_len="${BENCH_OUTPUT_LEN:-32}"
variant_filter="${BENCH_VARIANTS:-all}"
hf_mode="${BENCH_HF:-auto}"
hf_python="${HF_PYTHON:-python3}"
port="${BENCH_PORT:-18731}"
serve_extra="${BENCH_SERVE_ARGS:-}"
llamacpp_mode="${BENCH_LLAMACPP:-off}"
llamacpp_threads="${BENCH_LLAMACPP_THREADS:-$(nproc)}"
llamacpp_ctx="${BENCH_LLAMACPP_CTX:-4096}"
llamacpp_gguf="${BENCH_LLAMACPP_GGUF:-}"
llamacpp_extra="${BENCH_LLAMACPP_ARGS:-}"
baseline="${BENCH_BASELINE:-}"
out=""

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() { echo "bench_suite: $*" >&2; exit 1; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --family) need_value "$@"; family="$2"; shift 2 ;;
        --preset) need_value "$@"; preset="$2"; shift 2 ;;
        --model) need_value "$@"; model="$2"; shift 2 ;;
        --rounds) need_value "$@"; rounds="$2"; shift 2 ;;
        --concurrency) need_value "$@"; concurrency="$2"; shift 2 ;;
        --prompts-per-slot) need_value "$@"; prompts_per_slot="$2"; shift 2 ;;
        --input-len) need_value "$@"; input_len="$2"; shift 2 ;;
        --prefix-len) need_value "$@"; prefix_len="$2"; shift 2 ;;
        --output-len) need_value "$@"; output_len="$2"; shift 2 ;;
        --variants) need_value "$@"; variant_filter="$2"; shift 2 ;;
        --with-hf) hf_mode=on; shift ;;
        --no-hf) hf_mode=off; shift ;;
        --hf-python) need_value "$@"; hf_python="$2"; shift 2 ;;
        --with-llamacpp) llamacpp_mode=on; shift ;;
        --llamacpp-threads) need_value "$@"; llamacpp_threads="$2"; shift 2 ;;
        --llamacpp-ctx) need_value "$@"; llamacpp_ctx="$2"; shift 2 ;;
        --llamacpp-gguf) need_value "$@"; llamacpp_gguf="$2"; shift 2 ;;
        --llamacpp-args) need_value "$@"; llamacpp_extra="$2"; shift 2 ;;
        --baseline) need_value "$@"; baseline="$2"; shift 2 ;;
        --port) need_value "$@"; port="$2"; shift 2 ;;
        --serve-args) need_value "$@"; serve_extra="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$out" ]] || die "one OUT_DIR only (got '$out' and '$1')"; out="$1"; shift ;;
    esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a whole number >= 1, not '$rounds'"
[[ "$concurrency" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--concurrency takes a list like 1,4,16, not '$concurrency'"
[[ "$prefix_len" =~ ^[0-9]+$ ]] || die "--prefix-len must be a whole number, not '$prefix_len'"
[[ "$output_len" =~ ^[0-9]+$ && "$output_len" -ge 2 ]] || die "--output-len must be >= 2 (TPOT needs two tokens)"
out="${out:-$repo/bench-results/suite-$(date -u +%Y%m%d-%H%M%S)}"
case "$llamacpp_mode" in on|1|yes) llamacpp_mode=on ;; off|0|no) llamacpp_mode=off ;;
    *) die "BENCH_LLAMACPP must be on or off, not '$llamacpp_mode'" ;; esac
mkdir -p "$out"/{runs,logs,metrics,rss}
out="$(cd "$out" && pwd)"

# name|afd serve flags. Overlap on = 2 micro-batches; `-auto`: the default, whichever of 1 and 2
# the node measures to be faster.
all_variants=(
    "monolithic|--reference"
    "afd-1card|--cards 1 --micro-batches 2"
    "afd-2cards|--cards 2 --micro-batches 2"
    "afd-4cards|--cards 4 --micro-batches 2"
    "afd-2cards-no-overlap|--cards 2 --micro-batches 1"
    "afd-8cards|--cards 8 --micro-batches 2"
    "monolithic-bf16|--reference --activation-dtype bf16"
    "afd-2cards-bf16|--cards 2 --micro-batches 2 --activation-dtype bf16"
    "afd-2cards-bf16-no-overlap|--cards 2 --micro-batches 1 --activation-dtype bf16"
    "afd-8cards-bf16|--cards 8 --micro-batches 2 --activation-dtype bf16"
    "afd-2cards-auto|--cards 2"
    "afd-2cards-bf16-auto|--cards 2 --activation-dtype bf16"
    "afd-8cards-bf16-auto|--cards 8 --activation-dtype bf16"
    "afd-2cards-bf16-replicated|--cards 2 --activation-dtype bf16 --replicate-experts"
    "afd-2cards-one-copy|--cards 2 --replicate-experts false"
    "afd-2cards-bf16-one-copy|--cards 2 --activation-dtype bf16 --replicate-experts false"
    "afd-2cards-inproc|--cards 2 --transport inproc"
    "afd-2cards-bf16-inproc|--cards 2 --activation-dtype bf16 --transport inproc"
    "monolithic-mxint8|--reference --activation-dtype mxint8"
    "afd-2cards-mxint8|--cards 2 --micro-batches 2 --activation-dtype mxint8"
    "afd-8cards-mxint8|--cards 8 --micro-batches 2 --activation-dtype mxint8"
    "afd-8cards-mxint8-auto|--cards 8 --activation-dtype mxint8"
    "afd-2cards-ct2|--cards 2 --card-threads 2"
    "afd-2cards-no-prefix-caching|--cards 2 --no-enable-prefix-caching"
    "afd-2cards-bf16-ct2|--cards 2 --activation-dtype bf16 --card-threads 2"
    "afd-8cards-mxint8-ct2|--cards 8 --activation-dtype mxint8 --card-threads 2"
)
default_variants=",monolithic,afd-1card,afd-2cards,afd-4cards,afd-2cards-no-overlap,"
variants=()
for v in "${all_variants[@]}"; do
    name="${v%%|*}"
    if [[ ( "$variant_filter" == all && "$default_variants" == *",$name,"* ) || ",$variant_filter," == *",$name,"* ]]; then variants+=("$v"); fi
done
# llama-server is the peer, not an afd deployment: --with-llamacpp adds it to any selection.
# Two ways: as it loads by default (the GGUF memory-mapped: 4 KB page-cache pages), and
# `llama-server-hugepages`: read into its own buffers (`-lm none`) that glibc backs with
# transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1), as afd keeps its weights,
# so that the peer runs at its best on this kernel too.
if [[ $llamacpp_mode == on ]]; then variants+=("llama-server|" "llama-server-hugepages|-lm none"); fi
if [[ ${#variants[@]} -eq 0 ]]; then
    names=("${all_variants[@]%%|*}")
    die "--variants '$variant_filter' names none of: $(IFS=,; echo "${names[*]}" | sed 's/,/, /g')"
fi

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$out/suite.log" >&2; }

# --- build --------------------------------------------------------------------------------------
target="${CARGO_TARGET_DIR:-$repo/target}"
log "building afd and afd-loadtest (release) into $target"
(cd "$repo" && cargo build --release --bin afd --bin afd-loadtest) >"$out/logs/build.log" 2>&1 \
    || { tail -20 "$out/logs/build.log" >&2; die "the release build failed; see $out/logs/build.log"; }
afd="$target/release/afd"
loadtest="$target/release/afd-loadtest"

# --- checkpoint ---------------------------------------------------------------------------------
if [[ -z "$model" ]]; then
    model="$target/bench-models/$family-$preset"
    if [[ ! -f "$model/config.json" ]]; then
        log "afd synth --family $family --preset $preset --out $model"
        "$afd" synth --family "$family" --preset "$preset" --out "$model" >"$out/logs/synth.log" 2>&1 \
            || { cat "$out/logs/synth.log" >&2; die "afd synth failed"; }
    fi
fi
[[ -f "$model/config.json" ]] || die "no config.json in $model: pass a Hugging Face checkpoint folder with --model"

# --- llama.cpp ----------------------------------------------------------------------------------
if [[ $llamacpp_mode == on ]]; then
    log "llama.cpp: building (once) and converting $model (scripts/bench_llamacpp.sh)"
    llamacpp_flags=(--model "$model")
    if [[ -n "$llamacpp_gguf" ]]; then llamacpp_flags+=(--gguf "$llamacpp_gguf"); fi
    CARGO_TARGET_DIR="$target" "$repo/scripts/bench_llamacpp.sh" "${llamacpp_flags[@]}" \
        >"$out/logs/llamacpp.env" 2>"$out/logs/llamacpp.log" \
        || { tail -20 "$out/logs/llamacpp.log" >&2; die "scripts/bench_llamacpp.sh failed; see $out/logs/llamacpp.log"; }
    while IFS='=' read -r key value; do
        case "$key" in
            LLAMACPP_SERVER) llama_server="$value" ;;
            LLAMACPP_GGUF) llamacpp_gguf="$value" ;;
            LLAMACPP_VERSION) llamacpp_version="$value" ;;
        esac
    done <"$out/logs/llamacpp.env"
    [[ -x "${llama_server:-}" && -f "$llamacpp_gguf" ]] || die "scripts/bench_llamacpp.sh gave no server or GGUF; see $out/logs/llamacpp.log"
fi
# llama-server's slots: one per request of the largest concurrency.
llamacpp_slots=0
for c in ${concurrency//,/ }; do (( c > llamacpp_slots )) && llamacpp_slots=$c; done

vocab="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$model/config.json" 2>/dev/null || echo 1000)"
prompt_vocab=$(( vocab < 1000 ? vocab : 1000 ))

# --- machine ------------------------------------------------------------------------------------
{
    echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
    if [[ -n "${BENCH_COMMIT:-}" ]]; then
        echo "commit: $BENCH_COMMIT"
    else
        echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    fi
    echo "cores (nproc): $(nproc)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16' | tr '\n' ' ')"
    echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "busiest processes at start (%cpu command): $(ps -eo pcpu=,comm= --sort=-pcpu | head -5 | awk '{printf "%s %s; ", $1, $2}')"
    echo "model: $model ($(du -sh "$model" | cut -f1))"
    if [[ $llamacpp_mode == on ]]; then
        echo "llama.cpp: ${llamacpp_version:-unknown}; $llamacpp_gguf ($(du -h "$llamacpp_gguf" | cut -f1)); llama-server -t $llamacpp_threads -np $llamacpp_slots -kvu --no-cache-prompt -c $llamacpp_ctx $llamacpp_extra"
    fi
    shared=""; if [[ $prefix_len != 0 ]]; then shared=" after a shared prefix of $prefix_len"; fi
    echo "workload: input $input_len tokens$shared, output $output_len tokens (ignore_eos), concurrency $concurrency, $prompts_per_slot x concurrency requests per run (at least 4), $rounds round(s)"
} >"$out/machine.txt"
cat "$out/machine.txt" >&2

# --- the transformers peer ----------------------------------------------------------------------
run_hf=0
case "$hf_mode" in
    on|1|yes) run_hf=1 ;;
    off|0|no) run_hf=0 ;;
    *) if "$hf_python" -c 'import torch, transformers' >/dev/null 2>&1; then run_hf=1; fi ;;
esac
# The transformers script has no shared prefix: its workload would not be the same one.
if [[ $prefix_len != 0 && $run_hf == 1 ]]; then
    [[ $hf_mode == auto ]] || die "--with-hf cannot run --prefix-len (the transformers peer sends no shared prefix)"
    run_hf=0
fi
if [[ $run_hf == 1 ]]; then
    log "transformers peer: on ($hf_python)"
else
    log "transformers peer: skipped ($hf_python cannot import torch and transformers, or --no-hf; use --hf-python PATH or --with-hf)"
fi

# --- serving ------------------------------------------------------------------------------------
server_pid=""
stop_server() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill "$server_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    server_pid=""
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The peak resident memory of the running server, in MiB (VmHWM: model, KV cache, buffers).
peak_rss_mib() { awk '/^VmHWM:/ {printf "%.0f", $2 / 1024}' "/proc/$server_pid/status" 2>/dev/null; }

# run_variant NAME ROUND FLAGS...
run_variant() {
    local name="$1" round="$2"; shift 2
    local logfile="$out/logs/$name-r$round.log" what
    if port_busy "$port"; then die "port $port is in use; pick another with --port"; fi
    if [[ $name == llama-server* ]]; then
        what="llama-server"
        local tunables="${GLIBC_TUNABLES:-}"
        if [[ $name == llama-server-hugepages ]]; then tunables="glibc.malloc.hugetlb=1"; fi
        log "round $round: $name: ${tunables:+GLIBC_TUNABLES=$tunables }llama-server -t $llamacpp_threads -np $llamacpp_slots -kvu --no-cache-prompt -c $llamacpp_ctx $* $llamacpp_extra (load $(cut -d' ' -f1 /proc/loadavg))"
        # shellcheck disable=SC2086
        GLIBC_TUNABLES="$tunables" "$llama_server" -m "$llamacpp_gguf" --host 127.0.0.1 --port "$port" --alias bench \
            -t "$llamacpp_threads" -np "$llamacpp_slots" -kvu --no-cache-prompt -c "$llamacpp_ctx" \
            "$@" $llamacpp_extra >"$logfile" 2>&1 &
    else
        what="afd serve"
        log "round $round: $name: afd serve $* (load $(cut -d' ' -f1 /proc/loadavg))"
        # shellcheck disable=SC2086
        "$afd" serve --model "$model" --port "$port" --served-model-name bench "$@" $serve_extra \
            >"$logfile" 2>&1 &
    fi
    server_pid=$!
    local waited=0
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
        kill -0 "$server_pid" 2>/dev/null || { tail -20 "$logfile" >&2; die "$what ($name) exited; see $logfile"; }
        (( waited++ < 1200 )) || { stop_server; die "$what ($name) not healthy after 600 s; see $logfile"; }
        sleep 0.5
    done
    mkdir -p "$out/runs/$name"
    local c prompts
    for c in ${concurrency//,/ }; do
        prompts=$(( c * prompts_per_slot < 4 ? 4 : c * prompts_per_slot ))
        "$loadtest" --base-url "http://127.0.0.1:$port" --model bench \
            --max-concurrency "$c" --num-prompts "$prompts" \
            --input-len "$input_len" --prefix-len "$prefix_len" --output-len "$output_len" --ignore-eos \
            --vocab-size "$prompt_vocab" --seed "$round" --num-warmups 1 \
            --label "$name" --no-progress --no-plots \
            --result-dir "$out/runs/$name" --result-filename "r$round-c$c.json" \
            >>"$out/logs/$name-r$round.loadtest.log" 2>&1 \
            || { tail -20 "$out/logs/$name-r$round.loadtest.log" >&2; stop_server; die "afd-loadtest failed on $name at concurrency $c"; }
        log "  c=$c: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%.1f tok/s, median TPOT %.1f ms, %d failed" % (r["output_throughput"], r["median_tpot_ms"], r["failed"]))' "$out/runs/$name/r$round-c$c.json" 2>/dev/null || echo done)"
    done
    if [[ $name != llama-server* ]]; then
        curl -sf "http://127.0.0.1:$port/metrics" >"$out/metrics/$name-r$round.txt" || true
    fi
    peak_rss_mib >"$out/rss/$name-r$round.txt"
    stop_server
}

run_hf_peer() {
    local round="$1"
    log "round $round: hf-transformers: generate, batch sizes $concurrency"
    "$hf_python" "$repo/scripts/hf_generate_bench.py" --model "$model" --out "$out/hf/r$round" \
        --batch-sizes "$concurrency" --input-len "$input_len" --output-len "$output_len" \
        --vocab-size "$prompt_vocab" --seed "$round" --repeats 1 \
        >"$out/logs/hf-r$round.log" 2>&1 \
        || { tail -20 "$out/logs/hf-r$round.log" >&2; log "hf-transformers failed in round $round (see logs/hf-r$round.log); continuing without it"; }
}

started=$SECONDS
for round in $(seq "$rounds"); do
    # Rotate the order each round: every variant is first, middle and last in turn.
    n=${#variants[@]}
    for i in $(seq 0 $(( n - 1 ))); do
        entry="${variants[$(( (i + round - 1) % n ))]}"
        # shellcheck disable=SC2086
        run_variant "${entry%%|*}" "$round" ${entry#*|}
    done
    if [[ $run_hf == 1 ]]; then run_hf_peer "$round"; fi
done
log "measured in $(( SECONDS - started )) s; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/machine.txt"

# --- tables and plots ---------------------------------------------------------------------------
inputs=()
for v in "llama-server|" "llama-server-hugepages|" "${all_variants[@]}"; do
    name="${v%%|*}"
    if [[ -d "$out/runs/$name" ]]; then inputs+=("$name=$out/runs/$name"); fi
done
shopt -s nullglob
for dir in "$out"/hf/r*; do
    hf_files=("$dir"/*-concurrency*.json)
    if [[ ${#hf_files[@]} -gt 0 ]]; then inputs+=("hf-transformers=$dir"); fi
done
shopt -u nullglob
baseline="${baseline:-${inputs[0]%%=*}}"
# A checkpoint passed with --model is named by its folder; one synthesized here by family and preset.
if [[ "$model" == "$target/bench-models/$family-$preset" ]]; then model_name="$family $preset"; else model_name="$(basename "$model")"; fi
in_tokens="$input_len"; if [[ $prefix_len != 0 ]]; then in_tokens="$prefix_len shared + $input_len"; fi
title="$model_name, in $in_tokens / out $output_len tokens, $(nproc) cores"
"$loadtest" compare "${inputs[@]}" --baseline "$baseline" --out "$out" --title "$title" \
    >/dev/null 2>"$out/logs/compare.log" || { cat "$out/logs/compare.log" >&2; die "afd-loadtest compare failed"; }
if [[ -d "$out/runs/afd-2cards" && -d "$out/runs/afd-2cards-no-overlap" ]]; then
    "$loadtest" compare "overlap-off=$out/runs/afd-2cards-no-overlap" "overlap-on=$out/runs/afd-2cards" \
        --out "$out/overlap" --title "2 cards, overlap on vs off: $title" \
        >/dev/null 2>>"$out/logs/compare.log" || die "afd-loadtest compare (overlap) failed"
fi

# The cards' modeled time (Corsair performance model) per decode step and per output token,
# from each server's /metrics at the end of its runs (warm-up requests included).
python3 - "$out" >"$out/modeled.md" <<'EOF'
import glob, os, re, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "metrics", "*.txt"))):
    name = re.sub(r"-r\d+\.txt$", "", os.path.basename(path))
    cards, tokens, steps = {}, 0.0, 0.0
    for line in open(path):
        m = re.match(r'afd_card_modeled_seconds\{.*card="(\d+)".*\}\s+(\S+)', line)
        if m:
            cards[int(m.group(1))] = float(m.group(2))
        m = re.match(r"vllm:generation_tokens_total(\{[^}]*\})?\s+(\S+)", line)
        if m:
            tokens = float(m.group(2))
        m = re.match(r"afd_steps_total(\{[^}]*\})?\s+(\S+)", line)
        if m:
            steps = float(m.group(2))
    if cards and steps > 0 and tokens > 0:
        rows.setdefault(name, []).append((len(cards), max(cards.values()), sum(cards.values()), steps, tokens))
def median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
print("Per server (all its runs and warm-ups together), median over rounds.\n")
print("| variant | cards | rounds | steps | output tokens | busiest card, modeled ms per step | all cards, modeled ms per output token |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name, runs in sorted(rows.items(), key=lambda kv: (kv[1][0][0], kv[0])):
    print(f"| {name} | {runs[0][0]} | {len(runs)} | {median([r[3] for r in runs]):.0f} | "
          f"{median([r[4] for r in runs]):.0f} | {median([1000 * r[1] / r[3] for r in runs]):.3f} | "
          f"{median([1000 * r[2] / r[4] for r in runs]):.3f} |")
EOF

python3 - "$out" >"$out/rss.md" <<'EOF'
import glob, os, re, statistics, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "rss", "*.txt"))):
    text = open(path).read().strip()
    if text:
        rows.setdefault(re.sub(r"-r\d+\.txt$", "", os.path.basename(path)), []).append(float(text))
print("Peak resident memory of each server (VmHWM, at the end of its runs), median over rounds.\n")
print("| variant | rounds | peak RSS, MiB |")
print("|---|---:|---:|")
for name, values in sorted(rows.items()):
    print(f"| {name} | {len(values)} | {statistics.median(values):.0f} |")
EOF

if command -v rsvg-convert >/dev/null 2>&1; then
    for svg in "$out"/*.svg "$out"/overlap/*.svg; do
        [[ -f "$svg" ]] && rsvg-convert -b white "$svg" -o "${svg%.svg}.png"
    done
fi
log "done: $out/comparison.md (plots: tpot, throughput, ttft .svg/.png; overlap/; modeled.md; rss.md)"
cat "$out/comparison.md"
