#!/usr/bin/env bash
# A/B: afd serve (bundled model, defaults) at 1f052e8 (before issue 57) and at HEAD, c=1 and c=8, alternating.
# Expects the two builds' binaries in /tmp/ab/old (afd) and /tmp/ab/new (afd, afd-loadtest); writes /tmp/ab/results.
cd /work/main
out=/tmp/ab/results; mkdir -p $out
for round in 1 2 3; do
  for v in old new; do
    /tmp/ab/$v/afd serve --port 8011 > /tmp/ab/serve-$v.log 2>&1 &
    pid=$!
    for i in $(seq 300); do curl -sf localhost:8011/health >/dev/null && break; sleep 0.5; done
    for c in 1 8; do
      /tmp/ab/new/afd-loadtest --base-url http://127.0.0.1:8011 --num-prompts $((c==1?96:256)) --input-len 64 --output-len 64 \
        --ignore-eos --max-concurrency $c --num-warmups 2 --no-progress --no-plots \
        --result-dir $out --result-filename $v-c$c-r$round.json > /dev/null 2>&1
      python3 - $out/$v-c$c-r$round.json $v $c $round <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
print(f"{sys.argv[2]} c={sys.argv[3]} round {sys.argv[4]}: median TPOT {d['median_tpot_ms']:.2f} ms, output {d['output_throughput']:.1f} tok/s, failed {d.get('failed',0)}")
PY
    done
    kill -INT $pid; wait $pid
  done
done
