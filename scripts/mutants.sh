#!/usr/bin/env bash
# Mutation testing: plants small bugs (cargo-mutants: a `+` made `-`, a function returning its
# default, a condition inverted) in the code whose logic is pure and central, and counts how many
# the tests catch. Slow (each mutant rebuilds its crate and runs that crate's tests), so not in
# CI; docs/MUTATION.md has the figures and what was done about the survivors.
#
#   scripts/mutants.sh [AREA...]       areas: proto router step merge-dispatch compiler sanitizer
#                                      jetstream-codec (default: all of them)
#
# MUTANTS_ARGS adds cargo-mutants options, e.g. MUTANTS_ARGS=--in-place in a spare checkout
# (mutants are built in the tree itself, reusing its target folder, instead of in a copy that
# is built from nothing first). MUTANTS_TIMEOUT (seconds, default 300) bounds one mutant's
# tests: a mutant that loops forever costs that much.
#
# Each area's results go to target/mutation/AREA/mutants.out (caught.txt, missed.txt,
# timeout.txt, unviable.txt); the last line printed per area is its score:
# caught (timeouts count as caught: the mutant made the tests hang) over caught + missed
# (mutants that do not build are left out).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=27.1.0
if ! cargo mutants --version 2>/dev/null | grep -q "$VERSION"; then
  echo "installing cargo-mutants $VERSION (crates.io)" >&2
  cargo install --locked "cargo-mutants@$VERSION"
fi

# AREA -> package, files, and the tests that cover them (each crate's own: unit tests
# beside the code and its integration tests; `--lib` where the integration tests start whole
# clusters and add minutes a mutant without catching more).
area() {
  case "$1" in
    proto) pkg=proto; files=(proto/src/data/codec.rs proto/src/data/mod.rs); tests=() ;;
    router) pkg=router; files=(router/src/scheduler/mod.rs router/src/scheduler/block_manager.rs
      router/src/scheduler/request.rs); tests=(--lib) ;;
    step) pkg=step; files=(step/src/lib.rs step/src/clock.rs step/src/health.rs step/src/replicas.rs)
      tests=() ;;
    merge-dispatch) pkg=gpu-attention; files=(gpu-attention/src/merge/mod.rs gpu-attention/src/merge/score.rs
      gpu-attention/src/merge/filtered.rs gpu-attention/src/dispatch.rs); tests=(--lib) ;;
    compiler) pkg=corsair-ffn; files=(corsair-ffn/src/compiler/mod.rs corsair-ffn/src/compiler/emit.rs
      corsair-ffn/src/compiler/memory.rs corsair-ffn/src/compiler/tiling.rs)
      tests=() ;; # the fit, spill and bit-exact tests are integration tests (7 s in all)
    sanitizer) pkg=corsair-ffn; files=(corsair-ffn/src/sanitizer/mod.rs
      corsair-ffn/src/sanitizer/intervals.rs); tests=(--lib) ;;
    jetstream-codec) pkg=jetstream; files=(jetstream/src/codec.rs); tests=(--lib) ;;
    *) echo "unknown area '$1' (proto router step merge-dispatch compiler sanitizer jetstream-codec)" >&2
      exit 2 ;;
  esac
}

# The profile's incremental builds, whatever the caller's environment says.
export CARGO_INCREMENTAL=1

areas=("$@")
[ ${#areas[@]} -gt 0 ] || areas=(proto router step merge-dispatch compiler sanitizer jetstream-codec)
for a in "${areas[@]}"; do area "$a"; done # every name checked before hours of work start
mkdir -p target/mutation
failed=0

for a in "${areas[@]}"; do
  area "$a"
  # The `mutants` profile (Cargo.toml): incremental, the crate under test at a low opt-level.
  args=(--package "$pkg" --test-package "$pkg" --output "target/mutation/$a" --no-shuffle
    --timeout "${MUTANTS_TIMEOUT:-300}" --build-timeout 900 --profile mutants)
  for f in "${files[@]}"; do args+=(--file "$f"); done
  for t in "${tests[@]}"; do args+=(--cargo-test-arg "$t"); done
  # shellcheck disable=SC2206 # word splitting of the extra options is wanted
  args+=(${MUTANTS_ARGS:-})
  echo "== $a: cargo mutants ${args[*]}"
  started=$SECONDS
  # Exits non-zero when a mutant survives; the score below says how many.
  cargo mutants "${args[@]}" || true
  out="target/mutation/$a/mutants.out"
  count() { [ -f "$out/$1.txt" ] && wc -l <"$out/$1.txt" || echo 0; }
  caught=$(($(count caught) + $(count timeout)))
  missed=$(count missed)
  unviable=$(count unviable)
  total=$((caught + missed))
  if [ "$total" -eq 0 ]; then
    echo "== $a: no mutant was tested (cargo mutants failed: see above)" >&2
    failed=1
    continue
  fi
  pct=$(awk -v c="$caught" -v t="$total" 'BEGIN { printf "%.1f", 100 * c / t }')
  echo "== $a: $caught of $total caught ($pct%), $unviable unviable, $((SECONDS - started)) s;" \
    "survivors in $out/missed.txt"
done
exit "$failed"
