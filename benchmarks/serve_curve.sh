#!/usr/bin/env bash
# fastgen-serve under Poisson load, continuous batching (greedy-stream) against fixed batches (greedy), and
# CTranslate2 decoding the same server's fixed batches (--peer ctranslate2, where it is installed), one server
# process at a time on one torch thread, the load generator beside it: the figures of docs/serving.md.
#
#   bash benchmarks/serve_curve.sh [MODEL_DIR] [OUT_DIR] [RATES] [REQUESTS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (default bench_out/multi30k-base: bin/, raw/spm.model,
# raw/test1.en, base/checkpoint_best.pt); RATES are requests/s (one sentence each), REQUESTS per rate.
# MODES picks the servers ("fixed continuous ctranslate2", the default; ctranslate2 where it is installed); EXTRA
# adds server options to every mode (EXTRA="--quantize int8"). BASE overrides the checkpoint; BASE=untrained makes
# and takes an untrained checkpoint of the base shapes, its outputs capped at 25 tokens (training the base model
# takes hours on the CPU): the speed of the steps and of the batching, every sentence 25 tokens long.
set -euo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/serve}
RATES=${3:-5,10,15,20,25,30}
REQUESTS=${4:-1000}
PORT=${PORT:-8765}
BATCH=${BATCH:-32}
MODES=" ${MODES:-fixed continuous ctranslate2} "
BASE=${BASE:-$M/base/checkpoint_best.pt}
read -r -a EXTRA <<< "${EXTRA:-}"
ROWS="" source "$(dirname "$0")/bench_rows.sh"  # untrained
if [ "$BASE" = untrained ]; then
  BASE=$M/untrained/checkpoint_last.pt
  untrained transformer_wmt_en_de "$BASE"
  EXTRA=(--max-len-a 0 --max-len-b 25 "${EXTRA[@]}")
fi
COMMON=("$M/bin" --path "$BASE" --source-lang en --target-lang fr --cpu
        --bpe sentencepiece --sentencepiece-model "$M/raw/spm.model" --beam 1 --batch-size "$BATCH"
        --port "$PORT" --max-queue 100000 --request-timeout 600 "${EXTRA[@]}")

# one mode: start its server, wait for it, load it, stop it (SIGTERM: it answers what it holds and exits 0)
measure() {
  local label=$1; shift
  OMP_NUM_THREADS=1 .venv/bin/fastgen-serve "${COMMON[@]}" "$@" > "$OUT/$label.server.log" 2>&1 &
  local server=$!
  until grep -q "listening on" "$OUT/$label.server.log"; do
    kill -0 "$server" 2> /dev/null || { tail -5 "$OUT/$label.server.log"; return 1; }
    sleep 1
  done
  .venv/bin/python benchmarks/serve_load.py --url "http://127.0.0.1:$PORT" --sentences "$M/raw/test1.en" \
    --rates "$RATES" --requests "$REQUESTS" --concurrency 512 --slo-ms 1000 --warmup 20 --label "$label" \
    --output "$OUT/$label.json" "${COMPARE[@]}"
  kill -TERM "$server"
  wait "$server"
}

# the results of the modes measured before this one (this run's or an earlier one's), beside it and in the plot
compare() {
  COMPARE=()
  local earlier
  for earlier in "$@"; do
    [ -f "$OUT/$earlier.json" ] && COMPARE+=("$OUT/$earlier.json")
  done
  if [ ${#COMPARE[@]} -gt 0 ]; then COMPARE=(--compare "${COMPARE[@]}" --plot "$OUT/p99.png"); fi
}

if [[ "$MODES" == *" fixed "* ]]; then
  compare
  measure fixed --decoder greedy --batching fixed --fixed-batch-size "$BATCH" --fixed-batch-wait-ms 10
fi
if [[ "$MODES" == *" continuous "* ]]; then
  compare fixed
  measure continuous --decoder greedy-stream --batching continuous
fi
if [[ "$MODES" == *" ctranslate2 "* ]] && .venv/bin/python -c "import ctranslate2" 2> /dev/null; then
  compare fixed continuous
  measure ctranslate2 --decoder greedy --batching fixed --fixed-batch-size "$BATCH" --fixed-batch-wait-ms 10 \
    --peer ctranslate2
fi
