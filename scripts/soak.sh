#!/usr/bin/env bash
# Soak benchmark (not in CI): tens of thousands of mixed requests against `afd serve` on the
# bundled model, printing the server's resident memory and open file descriptors over time.
#
#   scripts/soak.sh [--requests N] [--concurrency C] [--interval S] [--port P] [-- SERVE_ARGS...]
#
# Builds `afd` in release (or uses $AFD), starts `afd serve` (2 cards over loopback QUIC, or
# whatever SERVE_ARGS say), waits for /health, and runs scripts/soak.py: plain and streamed
# completions, streams dropped by the client after one to four chunks, n > 1, several prompts
# per request, chat, and a few malformed requests, from C threads (default 30,000 requests, 16
# threads). Every S seconds (default 30) it prints RSS, open descriptors, KV-cache use, requests
# running and waiting, and failures so far; at the end the same once the server is idle, and a
# summary. Then it stops the server with SIGTERM and checks it drained and exited 0.
# Exit status: non-zero when a request failed or the server did not exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."

requests=30000
concurrency=16
interval=30
port=18123
serve_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --requests) requests="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --interval) interval="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --) shift; serve_args=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

afd="${AFD:-}"
if [[ -z "$afd" ]]; then
  cargo build --release --bin afd
  afd=target/release/afd
fi

log=$(mktemp -t afd-soak.XXXXXX.log)
"$afd" serve --port "$port" "${serve_args[@]}" 2>"$log" &
server=$!
stop_server() { kill -TERM "$server" 2>/dev/null || true; }
trap stop_server EXIT
for _ in $(seq 1 600); do
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then cat "$log" >&2; exit 1; fi
  sleep 0.5
done
echo "== $(grep -m1 "listening on" "$log" || true)"
echo "== $requests requests from $concurrency threads; server pid $server; log $log"

status=0
python3 scripts/soak.py --port "$port" --pid "$server" --requests "$requests" \
  --concurrency "$concurrency" --interval "$interval" || status=$?

trap - EXIT
kill -TERM "$server"
code=0
wait "$server" || code=$?
echo "== afd serve exited with $code after SIGTERM"
grep -E "draining|drained|panicked" "$log" || true
if [[ $code -ne 0 ]] || grep -q panicked "$log"; then status=1; fi
exit "$status"
