#!/usr/bin/env bash
# fastgen-serve under Poisson load, continuous batching (greedy-stream) against fixed batches (greedy), and
# CTranslate2 decoding the same server's fixed batches (--peer ctranslate2, where it is installed), one server
# process at a time on one torch thread, the load generator beside it: the figures of docs/serving.md.
#
#   bash benchmarks/serve_curve.sh [MODEL_DIR] [OUT_DIR] [RATES] [REQUESTS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (default bench_out/multi30k-base: bin/, raw/spm.model,
# raw/test1.en, base/checkpoint_best.pt); RATES are requests/s (one sentence each), REQUESTS per rate.
set -euo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/serve}
RATES=${3:-5,10,15,20,25,30}
REQUESTS=${4:-1000}
PORT=${PORT:-8765}
BATCH=${BATCH:-32}
mkdir -p "$OUT"
COMMON=("$M/bin" --path "$M/base/checkpoint_best.pt" --source-lang en --target-lang fr --cpu
        --bpe sentencepiece --sentencepiece-model "$M/raw/spm.model" --beam 1 --batch-size "$BATCH"
        --port "$PORT" --max-queue 100000 --request-timeout 600)

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

COMPARE=()
measure fixed --decoder greedy --batching fixed --fixed-batch-size "$BATCH" --fixed-batch-wait-ms 10
COMPARE=(--compare "$OUT/fixed.json" --plot "$OUT/p99.png")
measure continuous --decoder greedy-stream --batching continuous
if .venv/bin/python -c "import ctranslate2" 2> /dev/null; then
  COMPARE=(--compare "$OUT/fixed.json" "$OUT/continuous.json" --plot "$OUT/p99.png")
  measure ctranslate2 --decoder greedy --batching fixed --fixed-batch-size "$BATCH" --fixed-batch-wait-ms 10 \
    --peer ctranslate2
fi
