#!/usr/bin/env bash
# Peak RSS of whole fairseq-generate processes, --step-engine fairseq against compiled (docs/benchmarks.md,
# "Beside CTranslate2 (toy model)"): beam 5, batch 64, the 1,000 test sentences, one thread; a warm-up run
# compiles the unit for many rows into $FASTGEN_COMPILED_DIR, then RUNS interleaved runs of each (default 3).
#
#   bash benchmarks/engine_memory.sh [MODEL_DIR] [COMPILED_DIR]
set -euo pipefail
M=${1:-bench_out/multi30k}
export FASTGEN_COMPILED_DIR=${2:-bench_out/engine/compiled-steps} OMP_NUM_THREADS=1
run() {
  /usr/bin/time -f "$1 peak RSS %M KiB, %e s" .venv/bin/fairseq-generate "$M/bin" --path "$M/base/checkpoint_best.pt" \
      --user-dir fairseq_fastgen --cpu --gen-subset test --beam 5 --batch-size 64 --post-process sentencepiece \
      --quiet --step-engine "$2" 2>&1 >/dev/null | grep "^$1 peak RSS"
}
run warm-up compiled
for _ in $(seq "${RUNS:-3}"); do
  run fairseq fairseq
  run compiled compiled
done
