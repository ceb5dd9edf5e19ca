#!/usr/bin/env bash
# Streams whose refills take finished rows' places beside fixed batches (docs/benchmarks.md, "greedy-stream" and
# "blockwise-stream"):
# greedy beside greedy-stream --stream-join-lengths, blockwise (the frozen k = 4 student) beside
# blockwise-stream, at capacities 8 and 16 with a refill as soon as a row finishes (their default --stream-eps).
# One fastgen-bench run per decoder family and capacity, passes interleaved.
#
#   bash benchmarks/stream_joined.sh [MODEL_DIR] [OUT_DIR] [SENTENCES] [ENGINE]
#
# MODEL_DIR is what benchmarks/multi30k.py builds (bin/, base/checkpoint_best.pt, khead4/checkpoint_last.pt).
# Defaults: bench_out/multi30k, bench_out/stream-joined, 1,000 sentences, --step-engine static; REPEAT=N sets
# the timed passes per configuration (default 5), FAMILIES="greedy" leaves blockwise out (default "greedy blockwise"),
# CAPACITIES="4 8" the capacities (default "8 16"), ENGINE_OPTIONS="--compiled-freezing" adds engine options to
# every configuration.
set -euo pipefail
M=${1:-bench_out/multi30k}
OUT=${2:-bench_out/stream-joined}
SENTENCES=${3:-1000}
ENGINE=${4:-static}
BENCH=(.venv/bin/fastgen-bench "$M/bin" --path "$M/base/checkpoint_best.pt" --cpu --threads 1
       --post-process sentencepiece --repeat "${REPEAT:-5}" --no-ctranslate2 --step-engine "$ENGINE"
       --max-sentences "$SENTENCES" --beam 1 ${ENGINE_OPTIONS:-})
for CAPACITY in ${CAPACITIES:-8 16}; do
  for FAMILY in ${FAMILIES:-greedy blockwise}; do
    case $FAMILY in
      greedy) FAMILY_OPTIONS=(--stream-join-lengths) ;;
      *) FAMILY_OPTIONS=(--khead-path "$M/khead4/checkpoint_last.pt") ;;
    esac
    "${BENCH[@]}" --batch-size "$CAPACITY" --decoders "$FAMILY,$FAMILY-stream" --reference "$FAMILY" \
        "${FAMILY_OPTIONS[@]}" --output-dir "$OUT/$FAMILY-$CAPACITY"
  done
done
