#!/usr/bin/env bash
# Streaming (continuous batching) beside fixed batches: the rows of docs/benchmarks.md, "Streaming".
# One fastgen-bench run per engine and decoder family, each configuration measured in the same process
# with interleaved passes; a capacity is --batch-size (a streaming decoder reads whole pools and streams
# them through that many sources).
#
#   bash benchmarks/streaming.sh [MODEL_DIR] [OUT_DIR] [THREADS] [SENTENCES] [BEAM_SENTENCES] [ENGINES]
#
# MODEL_DIR is what benchmarks/multi30k.py builds (bin/, base/checkpoint_best.pt and, for blockwise,
# khead4/checkpoint_last.pt from --stop-after khead --khead-k 4). Defaults: bench_out/multi30k,
# bench_out/streaming, 1 thread, 1,000 sentences, 300 for the beam searches (beam 5 and 20), engines
# "fairseq static"; REPEAT=N sets the timed passes per configuration (default 3), FAMILIES the runs
# (default "greedy blockwise var-beam").
set -euo pipefail
M=${1:-bench_out/multi30k}
OUT=${2:-bench_out/streaming}
THREADS=${3:-1}
SENTENCES=${4:-1000}
BEAM_SENTENCES=${5:-300}
ENGINES=${6:-fairseq static}
BENCH=(.venv/bin/fastgen-bench "$M/bin" --path "$M/base/checkpoint_best.pt" --cpu --threads "$THREADS"
       --post-process sentencepiece --repeat "${REPEAT:-3}" --no-ctranslate2)
FAMILIES=${FAMILIES:-greedy blockwise var-beam}
# refills at 1/6 of the capacity (the cohort streams' default), 1/2 and 7/8
SIXTH=(--stream-eps 0.16666666666666666)
EPS=(--variant "eps-half=--stream-eps 0.5" --variant "eps-7of8=--stream-eps 0.875")
KHEAD=$M/khead4/checkpoint_last.pt

runs() { [[ " $FAMILIES " == *" $1 "* ]]; }

for ENGINE in $ENGINES; do
  runs greedy && "${BENCH[@]}" --step-engine "$ENGINE" --max-sentences "$SENTENCES" --batch-size 8,16,64 \
      --decoders greedy,greedy-stream --stream-cohorts --beam 1 --reference greedy "${SIXTH[@]}" "${EPS[@]}" \
      --output-dir "$OUT/greedy-$ENGINE-t$THREADS"
  if runs blockwise && [ -f "$KHEAD" ]; then
    "${BENCH[@]}" --step-engine "$ENGINE" --max-sentences "$SENTENCES" --batch-size 8,16,64 --khead-path "$KHEAD" \
        --decoders blockwise,blockwise-stream --beam 1 --reference blockwise "${SIXTH[@]}" "${EPS[@]}" \
        --output-dir "$OUT/blockwise-$ENGINE-t$THREADS"
  fi
  # var-batch beside var-stream: the default selection (least expanded first), fifo, and a budget of
  # capacity x beam candidate rows in place of the source count
  runs var-beam || continue
  for BEAM in 5 20; do
    for CAPACITY in 8 16 64; do
      "${BENCH[@]}" --step-engine "$ENGINE" --max-sentences "$BEAM_SENTENCES" --batch-size "$CAPACITY" \
          --decoders var-batch,var-stream --beam "$BEAM" --reference var-batch \
          --variant "fifo=--stream-selection fifo" --variant "budget=--stream-capacity-rows $((CAPACITY * BEAM))" \
          --output-dir "$OUT/var-beam$BEAM-bs$CAPACITY-$ENGINE-t$THREADS"
    done
  done
done
