#!/usr/bin/env bash
# The trained base's figures on the machine at hand, the rows of docs/benchmarks.md that read base/checkpoint_best.pt
# (not part of the product; base_pipeline.sh runs it once the base and its cluster files exist, before the students,
# so that every row runs alone on the machine):
#
#   bash benchmarks/trained_base_figures.sh [MODEL_DIR] [OUT_DIR]    # bench_out/multi30k-base, bench/trained-base
#
# 1. "Beside CTranslate2 (base size)": greedy at batch 1 and 64 and stock beam 5 at batch 64 on the default engine's
#    frozen units, each side in its own process (benchmarks/peer_alone.py), one thread and two, and with the
#    screened projection on one thread; one file per row in OUT_DIR, its last line peer_alone.py's summary;
# 2. model_sizes.sh's rows of the trained base alone: greedy at batch 64, stock beam 5, the screen, the cluster
#    projection, variable-width beams (OUT_DIR/sizes).
# A row whose file exists is kept (rerun: delete it).
set -uo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/trained-base}
PY=.venv/bin/python
mkdir -p "$OUT"
export FASTGEN_COMPILED_DIR=${FASTGEN_COMPILED_DIR:-$OUT/compiled-steps}
FROZEN="--engine-options=--step-engine compiled --compiled-freezing"

# peer_alone.py's summary for row $1 into OUT/$1.txt (kept when there), its arguments after the name
peer() {
  local file=$OUT/$1.txt
  shift
  if [ ! -s "$file" ]; then
    "$PY" benchmarks/peer_alone.py "$M/bin" "$M/base/checkpoint_best.pt" --rounds 1 "$@" > "$file.log" 2>&1 \
      && tail -1 "$file.log" > "$file" || { tail -3 "$file.log"; return; }
  fi
  echo "== $(cat "$file")"
}

for THREADS in 1 2; do
  peer "greedy-bs1-threads$THREADS" --threads $THREADS --beam 1 --batch-size 1 --sentences 100 "$FROZEN"
  peer "greedy-bs64-threads$THREADS" --threads $THREADS --beam 1 --batch-size 64 --sentences 256 "$FROZEN"
  peer "beam5-bs64-threads$THREADS" --threads $THREADS --beam 5 --batch-size 64 --sentences 192 "$FROZEN"
done
SCREEN="$FROZEN --screened-projection"
peer greedy-bs1-screen --beam 1 --batch-size 1 --sentences 100 "$SCREEN"
peer greedy-bs64-screen --beam 1 --batch-size 64 --sentences 256 "$SCREEN"
peer beam5-bs64-screen --beam 5 --batch-size 64 --sentences 192 "$SCREEN"

bash benchmarks/model_sizes.sh "$M" "$OUT/sizes" "bs64 beam5 screen clusters varbeam"
