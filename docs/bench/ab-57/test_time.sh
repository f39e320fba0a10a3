#!/bin/bash
# Issue 57's test-time A/B: `cargo test --workspace` from an empty target dir, as CI runs it,
# at 1f052e8 (before the redesign; a worktree: git worktree add --detach /tmp/t57-before 1f052e8)
# and at HEAD (/work/main), one after the other on this machine. Times in /tmp/t57.times.
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=false CARGO_PROFILE_DEV_STRIP=debuginfo
export AFD_PYTHON=/tmp/venv/bin/python
for side in before after; do
  if [ $side = before ]; then dir=/tmp/t57-before; else dir=/work/main; fi
  cd $dir
  rm -rf target/debug
  echo "$side $(git rev-parse --short HEAD) start $(date -u +%T)" >> /tmp/t57.times
  s=$(date +%s)
  cargo test --workspace > /tmp/t57-$side.log 2>&1
  rc=$?
  e=$(date +%s)
  echo "$side rc=$rc wall=$((e-s))s end $(date -u +%T)" >> /tmp/t57.times
done
echo finished >> /tmp/t57.times
