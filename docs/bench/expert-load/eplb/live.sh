#!/bin/bash
# Live --eplb A/B on the bundled model: two phases of traffic, TPOT and balancedness per phase
# (docs/bench/notes/2026-12-07-eplb.md). Needs `cargo build --release -p deploy --bin afd -p
# loadtest --bin afd-loadtest`. Usage: live.sh [OUT_DIR]
set -u
cd "$(dirname "$0")/../../../.."
AFD=target/release/afd; LT=target/release/afd-loadtest
OUT=${1:-/tmp/eplb-live}; PORT=8123
mkdir -p "$OUT"
for round in 1 2; do for mode in static eplb; do
  extra=""
  [ $mode = eplb ] && extra="--eplb --eplb-window 64 --eplb-step-interval 64 --num-redundant-experts 4"
  RUST_LOG=info $AFD serve --cards 4 --replicate-experts false --port $PORT $extra > $OUT/$mode-$round.serve.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
  for phase in austen ids; do
    if [ $phase = austen ]; then P="--prompt-source file --prompt-file docs/bench/austen-prompts.txt"; else P="--prompt-source token-ids --vocab-size 2000"; fi
    $LT --base-url http://127.0.0.1:$PORT --endpoint completions --num-prompts 144 --input-len 128 --output-len 64 --ignore-eos --max-concurrency 8 --request-rate inf --seed 1 $P --result-dir $OUT --result-filename $mode-$phase-$round.json --no-plots --no-progress --label $mode-$phase-$round > $OUT/$mode-$phase-$round.lt.log 2>&1
    curl -s localhost:$PORT/metrics | grep -E "^afd_expert_balancedness\{|^afd_expert_tokens_total" > $OUT/$mode-$phase-$round.metrics
  done
  kill -INT $pid; wait $pid
done; done
echo finished > $OUT/finished
