#!/usr/bin/env bash
# Whole fairseq-generate processes (start-up, loading, compilation, decoding, printing) at beam 5, batch 64:
# stock fairseq-generate (no plugin); the plugin on --step-engine static; the plugin with no engine option (the
# default, --step-engine auto: on the CPU compiled --compiled-freezing with its units compiled in the background),
# once as a first run (an empty TORCHINDUCTOR_CACHE_DIR and FASTGEN_COMPILED_DIR: the decode runs eager while a
# child process compiles one unit beside it; the script waits for that child before the next process, outside the
# timing) and once as a later run (every unit on disk, compiled once before the rounds, untimed); and
# --step-engine compiled (COMPILED_OPTIONS) with an empty cache and with the cache it left. Wall seconds per
# process, the processes interleaved round by round; prints each round and the medians, and how many hypotheses
# (H- lines: sentence id and text) and printed scores each process shares with stock fairseq-generate, and each
# process's largest peak RSS (GNU time's maximum resident set size of the decoding process).
#
#   bash benchmarks/engine_whole_process.sh [MODEL_DIR] [ROUNDS] [THREADS]
#
# Environment: BEAM (5), BATCH (64), PLUGIN_OPTIONS (options of every plugin process, e.g. "--decoder greedy"),
# COMPILED_OPTIONS (options of the compiled ones, e.g. "--compiled-freezing"), CHECKPOINT (MODEL_DIR/base/
# checkpoint_best.pt), EXTRA (options of every process, e.g. "--max-len-a 0 --max-len-b 25"), COMPILED_ROWS ("no":
# leave out the two --step-engine compiled rows).
set -euo pipefail
M=${1:-bench_out/multi30k}
ROUNDS=${2:-3}
export OMP_NUM_THREADS=${3:-1}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
read -r -a EXTRA_OPTIONS <<< "${EXTRA:-}"
OPTIONS=("$M/bin" --path "${CHECKPOINT:-$M/base/checkpoint_best.pt}" --cpu --beam "${BEAM:-5}"
         --batch-size "${BATCH:-64}" --required-batch-size-multiple 1 --post-process sentencepiece "${EXTRA_OPTIONS[@]}")
unset FASTGEN_STEP_ENGINE  # the default's own choice
read -r -a PLUGIN_EXTRA <<< "${PLUGIN_OPTIONS:-}"
read -r -a COMPILED <<< "--step-engine compiled ${COMPILED_OPTIONS:-}"
STOCK=(.venv/bin/python fairseq_fastgen/stock_fairseq.py generate)  # fairseq-generate without the plugin
PLUGIN=(.venv/bin/fairseq-generate --user-dir fairseq_fastgen "${PLUGIN_EXTRA[@]}")

run() {  # NAME COMMAND...: one process; appends its wall seconds to $WORK/NAME.times
  local name=$1
  shift
  local start end
  start=$(date +%s.%N)
  /usr/bin/time -f %M -a -o "$WORK/$name.rss" "$@" "${OPTIONS[@]}" > "$WORK/$name.out" 2> "$WORK/$name.err"
  end=$(date +%s.%N)
  echo "$end - $start" | bc >> "$WORK/$name.times"
  grep '^H-' "$WORK/$name.out" | sort > "$WORK/$name.hyp"  # H-id, score (base 2), text
}

use_cache() {  # NAME: torch.compile's code and the units compiled ahead of time go to (and come from) $WORK/NAME
  export TORCHINDUCTOR_CACHE_DIR="$WORK/$1" FASTGEN_COMPILED_DIR="$WORK/$1/fairseq_fastgen"
}

wait_for_children() {  # the background compilations NAME's process started: they end untimed
  for child in $(grep -o 'in the background (process [0-9]*' "$WORK/$1.err" | grep -o '[0-9]*$'); do
    while kill -0 "$child" 2> /dev/null; do sleep 1; done
  done
}

# the later runs' cache: every unit the default's decode needs, compiled in the foreground once, untimed
(use_cache cache-later
 "${PLUGIN[@]}" --step-engine compiled --compiled-freezing "${OPTIONS[@]}" > /dev/null 2> "$WORK/later-compile.err")
NAMES="stock static default-first default-later"
[ "${COMPILED_ROWS:-yes}" = no ] || NAMES="$NAMES compiled-cold compiled-warm"
for round in $(seq "$ROUNDS"); do
  run stock "${STOCK[@]}"
  run static "${PLUGIN[@]}" --step-engine static
  use_cache "cache-first-$round"
  run default-first "${PLUGIN[@]}"
  wait_for_children default-first
  use_cache cache-later
  run default-later "${PLUGIN[@]}"
  wait_for_children default-later  # none, unless the decode met a unit the foreground run did not
  if [[ "$NAMES" == *compiled-cold* ]]; then
    use_cache "cache-$round"
    run compiled-cold "${PLUGIN[@]}" "${COMPILED[@]}"
    run compiled-warm "${PLUGIN[@]}" "${COMPILED[@]}"
  fi
  unset TORCHINDUCTOR_CACHE_DIR FASTGEN_COMPILED_DIR
  echo "round $round: $(for n in $NAMES; do printf '%s %.1f s  ' $n "$(tail -1 "$WORK/$n.times")"; done)"
done
for name in $NAMES; do
  median=$(sort -n "$WORK/$name.times" | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
  texts=$(paste <(cut -f1,3 "$WORK/$name.hyp") <(cut -f1,3 "$WORK/stock.hyp") | awk -F'\t' '$1 == $3 && $2 == $4' | wc -l)
  scores=$(paste <(cut -f2 "$WORK/$name.hyp") <(cut -f2 "$WORK/stock.hyp") | awk -F'\t' '$1 == $2' | wc -l)
  rss=$(sort -n "$WORK/$name.rss" | tail -1)  # KiB, the decoding process's (a compiling child is not its)
  printf '%-19s median %6.1f s over %s processes, peak RSS %s MB; as stock: %s of %s hypotheses, %s printed scores\n' \
      "$name" "$median" "$ROUNDS" "$((rss / 1024))" "$texts" "$(wc -l < "$WORK/stock.hyp")" "$scores"
done
