#!/usr/bin/env bash
# fastgen-serve across client disconnects and a restart (docs/serving.md, "Nothing lost"): 10,000 requests of 1-2
# sentences at Poisson arrivals against continuous batching (greedy-stream, one torch thread), a tenth of the
# clients hanging up within 2 s, SIGTERM once midway and the server started again; the counts of answered, refused,
# disconnected, failed and lost requests and of crossed answers.
#
#   bash benchmarks/serve_resilience.sh [MODEL_DIR] [OUT_DIR] [RATE] [REQUESTS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (default bench_out/multi30k-base).
set -euo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/serve-resilience}
RATE=${3:-9}
REQUESTS=${4:-10000}
PORT=${PORT:-8766}
mkdir -p "$OUT"
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_resilience.py --sentences "$M/raw/test1.en" --rate "$RATE" \
  --requests "$REQUESTS" --most-sentences 2 --disconnect-share 0.1 --disconnect-within 2 --restart-at 0.5 \
  --server-log "$OUT/server.log" --output "$OUT/resilience.json" -- \
  .venv/bin/fastgen-serve "$M/bin" --path "$M/base/checkpoint_best.pt" --source-lang en --target-lang fr --cpu \
  --bpe sentencepiece --sentencepiece-model "$M/raw/spm.model" --decoder greedy-stream --beam 1 --batch-size 32 \
  --port "$PORT" --max-queue 100000 --request-timeout 600 --grace-period 10
