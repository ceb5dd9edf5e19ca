#!/usr/bin/env bash
# Whole fairseq-generate processes (start-up, loading, compilation, decoding, printing) at beam 5, batch 64:
# stock fairseq-generate (no plugin), the plugin on fairseq's step (the default for --decoder beam) and the
# plugin with --step-engine compiled, once with an empty compile cache (a fresh TORCHINDUCTOR_CACHE_DIR and
# FASTGEN_COMPILED_DIR: torch.compile's code and the steps compiled ahead of time) and once with the cache the
# previous compiled process left, and once with --compile-in-background and an empty cache (the decode runs
# eager while a child process compiles; the script waits for that child before the next process, outside the
# timing). Wall seconds per process, the five processes interleaved round by round; prints each round and the medians, and how many hypotheses (H- lines:
# sentence id and text) and printed scores each process shares with stock fairseq-generate.
#
#   bash benchmarks/engine_whole_process.sh [MODEL_DIR] [ROUNDS] [THREADS]
#
# Environment: BEAM (5), BATCH (64), PLUGIN_OPTIONS (options of every plugin process, e.g. "--decoder greedy"),
# COMPILED_OPTIONS (options of the compiled ones, e.g. "--compiled-freezing").
set -euo pipefail
M=${1:-bench_out/multi30k}
ROUNDS=${2:-3}
export OMP_NUM_THREADS=${3:-1}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OPTIONS=("$M/bin" --path "$M/base/checkpoint_best.pt" --cpu --beam "${BEAM:-5}" --batch-size "${BATCH:-64}"
         --required-batch-size-multiple 1 --post-process sentencepiece)
read -r -a PLUGIN_EXTRA <<< "${PLUGIN_OPTIONS:-}"
read -r -a COMPILED <<< "--step-engine compiled ${COMPILED_OPTIONS:-}"
STOCK=(.venv/bin/python fairseq_fastgen/stock_fairseq.py generate)  # fairseq-generate without the plugin
PLUGIN=(.venv/bin/fairseq-generate --user-dir fairseq_fastgen "${PLUGIN_EXTRA[@]}")

run() {  # NAME COMMAND...: one process; appends its wall seconds to $WORK/NAME.times
  local name=$1
  shift
  local start end
  start=$(date +%s.%N)
  "$@" "${OPTIONS[@]}" > "$WORK/$name.out" 2> "$WORK/$name.err"
  end=$(date +%s.%N)
  echo "$end - $start" | bc >> "$WORK/$name.times"
  grep '^H-' "$WORK/$name.out" | sort > "$WORK/$name.hyp"  # H-id, score (base 2), text
}

for round in $(seq "$ROUNDS"); do
  run stock "${STOCK[@]}"
  run plugin "${PLUGIN[@]}"
  export TORCHINDUCTOR_CACHE_DIR="$WORK/cache-$round" FASTGEN_COMPILED_DIR="$WORK/cache-$round/fairseq_fastgen"
  run compiled-cold "${PLUGIN[@]}" "${COMPILED[@]}"
  run compiled-warm "${PLUGIN[@]}" "${COMPILED[@]}"
  export TORCHINDUCTOR_CACHE_DIR="$WORK/cache-bg-$round" FASTGEN_COMPILED_DIR="$WORK/cache-bg-$round/fairseq_fastgen"
  run compiled-background "${PLUGIN[@]}" "${COMPILED[@]}" --compile-in-background
  for child in $(grep -o 'in the background (process [0-9]*' "$WORK/compiled-background.err" | grep -o '[0-9]*$'); do
    while kill -0 "$child" 2> /dev/null; do sleep 1; done  # its compilation ends untimed
  done
  unset TORCHINDUCTOR_CACHE_DIR FASTGEN_COMPILED_DIR
  echo "round $round: $(for n in stock plugin compiled-cold compiled-warm compiled-background; do printf '%s %.1f s  ' $n "$(tail -1 "$WORK/$n.times")"; done)"
done
for name in stock plugin compiled-cold compiled-warm compiled-background; do
  median=$(sort -n "$WORK/$name.times" | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
  texts=$(paste <(cut -f1,3 "$WORK/$name.hyp") <(cut -f1,3 "$WORK/stock.hyp") | awk -F'\t' '$1 == $3 && $2 == $4' | wc -l)
  scores=$(paste <(cut -f2 "$WORK/$name.hyp") <(cut -f2 "$WORK/stock.hyp") | awk -F'\t' '$1 == $2' | wc -l)
  printf '%-19s median %6.1f s over %s processes; as stock: %s of %s hypotheses, %s printed scores\n' \
      "$name" "$median" "$ROUNDS" "$texts" "$(wc -l < "$WORK/stock.hyp")" "$scores"
done
