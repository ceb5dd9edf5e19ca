#!/usr/bin/env bash
# --quantize int8 and bf16 at the base size (transformer_wmt_en_de shapes, 32k BPE vocabulary), beside float32 and
# CTranslate2 in int8: the rows of docs/benchmarks.md, "Precision". One fastgen-bench run per row, its
# configurations measured in one process with interleaved passes, one thread; a row whose results.json exists is
# kept (rerun: delete its folder). Identical outputs are counted against float32 greedy (beam 5: float32 beam 5).
#
#   bash benchmarks/precision.sh [MODEL_DIR] [OUT_DIR] [ROWS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (defaults bench_out/multi30k-base, bench/precision,
# every row). ROWS picks rows by name: "bs1 bs64 beam5 blockwise". CTranslate2 (compute_type int8) joins when
# installed; this CPU's CTranslate2 build offers no bfloat16, so bf16 is compared with our float32 only.
# BASE overrides the checkpoint; BASE=untrained makes and takes an untrained checkpoint of the base shapes (speed
# alone, outputs capped at 25 tokens; training the base model takes hours on the CPU). EXTRA adds fastgen-bench
# options to every row.
set -uo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/precision}
ROWS=" ${3:-bs1 bs64 beam5 blockwise} "
BASE=${BASE:-$M/base/checkpoint_best.pt}
read -r -a EXTRA <<< "${EXTRA:-}"
source "$(dirname "$0")/bench_rows.sh"  # wanted, row, untrained
if [ "$BASE" = untrained ]; then
  BASE=$M/untrained/checkpoint_last.pt
  untrained transformer_wmt_en_de "$BASE"
  EXTRA=(--max-len-a 0 --max-len-b 25 "${EXTRA[@]}")
fi
KHEAD=$M/khead4/checkpoint_last.pt
PRECISIONS=("${EXTRA[@]}" --ctranslate2-compute-type int8 --variant "int8=--quantize int8"
            --variant "int8-compiled=--quantize int8 --step-engine compiled"
            --variant "int8-library=--quantize int8 --int8-library-kernels"
            --variant "int8-f32vocab=--quantize int8 --float32-vocabulary-projection" --variant "bf16=--quantize bf16")

wanted bs1 && row greedy-bs1 --path "$BASE" --decoders greedy --beam 1 --batch-size 1 --max-sentences 100 \
  --repeat 2 --reference greedy --step-engine static "${PRECISIONS[@]}"
wanted bs64 && row greedy-bs64 --path "$BASE" --decoders greedy --beam 1 --batch-size 64 --repeat 2 \
  --reference greedy --step-engine static "${PRECISIONS[@]}"
wanted beam5 && row beam5-bs64 --path "$BASE" --decoders beam --beam 5 --batch-size 64 --max-sentences 192 \
  --repeat 2 --step-engine static "${PRECISIONS[@]}"
# blockwise (the frozen-base k = 4 student) against greedy, both in int8; the proposals of heads 2-4 through
# int8 copies of the k-head layer and the vocabulary projection (--blockwise-int8-proposals) or the int8 rows of every layer
wanted blockwise && row blockwise-int8-bs1 --path "$BASE" --khead-path "$KHEAD" --decoders greedy,blockwise --beam 1 \
  --batch-size 1 --max-sentences 60 --repeat 2 --reference greedy --step-engine static --no-ctranslate2 \
  --quantize int8 --variant "proposals=--blockwise-int8-proposals"
