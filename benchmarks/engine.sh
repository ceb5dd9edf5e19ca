#!/usr/bin/env bash
# The decoder-step engine (--step-engine fairseq / static / compiled) beside CTranslate2 float32 on the toy model:
# the figures of docs/benchmarks.md, "Beside CTranslate2 (toy model)" (under "The decoder-step engine"). One
# fastgen-bench run per row, every configuration of a row measured in the same process with interleaved passes.
#
#   bash benchmarks/engine.sh [MODEL_DIR] [OUT_DIR] [THREADS] [SENTENCES]
#
# MODEL_DIR is what benchmarks/multi30k.py builds (bin/, base/checkpoint_best.pt); CTranslate2 joins when
# it is installed (pip install ctranslate2). Defaults: bench_out/multi30k, bench_out/engine, 1 thread, all
# 1,000 sentences of test_2016_flickr.
set -euo pipefail
M=${1:-bench_out/multi30k}
OUT=${2:-bench_out/engine}
THREADS=${3:-1}
SENTENCES=${4:-1000}
BENCH=(.venv/bin/fastgen-bench "$M/bin" --path "$M/base/checkpoint_best.pt" --cpu --threads "$THREADS"
       --post-process sentencepiece --max-sentences "$SENTENCES" --repeat 3 --step-engine fairseq)
EACH_ENGINE=(--variant "static=--step-engine static" --variant "compiled=--step-engine compiled"
             --variant "frozen=--step-engine compiled --compiled-freezing")
# the compiled steps are compiled into an empty directory, so the compile seconds of the first rows are a cold
# start (later rows and runs load what the first compiled)
export FASTGEN_COMPILED_DIR=${FASTGEN_COMPILED_DIR:-$OUT/compiled-steps}

# greedy, batch 1 and batch 64: the reference is greedy on fairseq's step (token-identical to stock --beam 1)
for BATCH in 1 64; do
  "${BENCH[@]}" --decoders greedy --beam 1 --batch-size "$BATCH" --reference greedy "${EACH_ENGINE[@]}" \
      --output-dir "$OUT/greedy-bs$BATCH-t$THREADS"
done
# stock fairseq beam search, beam 5, batch 64 (--step-engine static keeps fairseq's step for it: not run)
"${BENCH[@]}" --decoders beam --beam 5 --batch-size 64 --variant "compiled=--step-engine compiled" \
    --variant "frozen=--step-engine compiled --compiled-freezing" --output-dir "$OUT/beam5-bs64-t$THREADS"
# blockwise (the k = 4 student of benchmarks/multi30k.py --stop-after khead) beside greedy on each engine,
# batch 1, 300 sentences; the student's head 1 is the base model, so both give the same tokens
KHEAD=$M/khead4/checkpoint_last.pt
if [ -f "$KHEAD" ]; then
  "${BENCH[@]}" --max-sentences 300 --khead-path "$KHEAD" --decoders greedy,blockwise --beam 1 --batch-size 1 \
      --reference greedy --no-ctranslate2 "${EACH_ENGINE[@]}" \
      --variant "frozen-int8=--step-engine compiled --compiled-freezing --blockwise-int8-proposals" \
      --output-dir "$OUT/blockwise-bs1-t$THREADS"
fi
