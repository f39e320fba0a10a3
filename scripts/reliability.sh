#!/usr/bin/env bash
# Reliability figures: kill -9 / restart / SIGSTOP timings (fixture), throughput with one card
# down and replicas covering it vs all up (medium model, every expert on both cards), release
# build: cargo build --release --bin afd --bin afd-loadtest; bash scripts/reliability.sh. Run from
# the repository root; MEDIUM= names another checkpoint folder (16 experts per layer).
set -u
B=${AFD_BIN:-target/release}
W=$(mktemp -d); B=$(realpath $B); FIXTURE=$(realpath fixtures/gpt-oss-mxfp4); MEDIUM=${MEDIUM:-/work/ckpt/gpt-oss-medium}; cd $W
now() { date +%s.%N; }
el() { python3 -c "print(f'{$2-$1:.2f}')"; }
health() { curl -s -o /dev/null -w "%{http_code}" --max-time 2 localhost:$HTTP/health; }
compl() { curl -s -o /dev/null -w "%{http_code}" --max-time 30 localhost:$HTTP/v1/completions -H 'Content-Type: application/json' -d '{"model":"m","prompt":[12,34,67],"max_tokens":4,"temperature":0,"ignore_eos":true}'; }
start() { # $1 model $2 replicas(0/1) $3 tag
  MODEL=$1; TAG=$3; P=$((42000 + RANDOM % 2000)); HTTP=$((P+10))
  $B/afd certs --out certs-$TAG --nodes attn-0,frontend,card-0,card-1 > /dev/null
  REPL=""; if [ $2 = 1 ]; then REPL=$(python3 -c "print(', '.join('{ expert = %d }'%e for e in range(16)))"); fi
  printf '[model]\npath = "%s"\n[cards]\ncount = 2\nreplicas = [%s]\n[attention]\nmax_num_seqs = 16\nmax_model_len = 1024\n' $MODEL "$REPL" > d-$TAG.toml
  for k in 0 1; do $B/afd card --id $k --listen 127.0.0.1:$((P+k)) --certs certs-$TAG > card$k-$TAG.log 2>&1 & eval CARD$k=$!; done
  sleep 1
  $B/afd attention --deployment d-$TAG.toml --cards 127.0.0.1:$P,127.0.0.1:$((P+1)) --listen 127.0.0.1:$((P+5)) --data-listen 127.0.0.1:0 --certs certs-$TAG > attn-$TAG.log 2>&1 & ATTN=$!
  $B/afd frontend --attention-addrs 127.0.0.1:$((P+5)) --model $MODEL --port $HTTP --served-model-name m --max-num-seqs 16 --max-model-len 1024 --certs certs-$TAG > fe-$TAG.log 2>&1 & FE=$!
  for i in $(seq 600); do [ "$(health)" = 200 ] && break; sleep 0.5; done
  echo "[$TAG] up: /health $(health)"
}
stop() { kill $FE; sleep 1; kill $ATTN; sleep 1; kill $CARD0 $CARD1 2>/dev/null; wait 2>/dev/null; }
restart1() { $B/afd card --id 1 --listen 127.0.0.1:$((P+1)) --certs certs-$TAG >> card1-$TAG.log 2>&1 & CARD1=$!; }

# --- timings, fixture model, nothing replicated
start $FIXTURE 0 fx
for rep in 1 2; do
  compl >/dev/null
  t0=$(now); kill -9 $CARD1; wait $CARD1 2>/dev/null
  while [ "$(compl)" != 503 ]; do :; done; t503=$(now)
  while [ "$(health)" != 503 ]; do :; done; th=$(now)
  t1=$(now); restart1
  while [ "$(health)" != 200 ]; do sleep 0.01; done; tup=$(now)
  while [ "$(compl)" != 200 ]; do sleep 0.01; done; tok=$(now)
  echo "kill -9 #$rep: first 503 after $(el $t0 $t503) s, /health 503 after $(el $t0 $th) s; restart -> /health 200 after $(el $t1 $tup) s, first 200 completion after $(el $t1 $tok) s"
done
for rep in 1 2; do
  t0=$(now); kill -STOP $CARD1
  while [ "$(health)" != 503 ]; do sleep 0.01; done; th=$(now)
  c=$(compl); tc=$(now)
  t1=$(now); kill -CONT $CARD1
  while [ "$(health)" != 200 ]; do sleep 0.01; done; tup=$(now)
  echo "SIGSTOP #$rep: /health 503 after $(el $t0 $th) s (a completion then: $c); SIGCONT -> /health 200 after $(el $t1 $tup) s"
done
stop

# --- throughput, medium model, every expert on both cards
start $MEDIUM 1 md
lt() { $B/afd-loadtest --base-url http://127.0.0.1:$HTTP --model m --num-prompts 16 --input-len 64 --output-len 64 --ignore-eos --max-concurrency 4 --num-warmups 2 --no-save --no-plots --no-progress --label "$1" 2>&1 | grep -iE "output token throughput|successful|failed" ; }
echo "== all cards up"; lt up1
kill -9 $CARD1; wait $CARD1 2>/dev/null
for i in $(seq 200); do curl -s localhost:$HTTP/health | grep -q degraded && break; sleep 0.05; done
echo "health while card 1 down: $(curl -s localhost:$HTTP/health)"
echo "== card 1 down, replicas cover it"; lt down
restart1; for i in $(seq 600); do curl -s localhost:$HTTP/health | grep -q degraded || break; sleep 0.1; done
echo "== card 1 back"; lt up2
stop
