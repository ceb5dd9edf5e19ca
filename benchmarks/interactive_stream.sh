#!/usr/bin/env bash
# fairseq-interactive with lines entering the stream as they arrive against the same decoder on fixed
# --buffer-size blocks (docs/benchmarks.md, "fairseq-interactive: lines entering the stream as they arrive"):
# whole processes on the Multi30k en-fr base model (benchmarks/multi30k.py),
# the first N lines of test_2016_flickr piped in, one thread, REPEAT interleaved runs, median wall seconds,
# and whether the hypotheses are identical.  Usage: bash benchmarks/interactive_stream.sh [N] [REPEAT]
set -euo pipefail
N=${1:-1000}; REPEAT=${2:-3}
ROOT=bench_out/multi30k; OUT=${OUT:-bench_out/interactive_stream}; mkdir -p "$OUT"
head -n "$N" "$ROOT/raw/test.en" > "$OUT/input.en"
COMMON=("$ROOT/bin" --path "$ROOT/base/checkpoint_best.pt" --user-dir fairseq_fastgen --cpu --source-lang en
        --target-lang fr --buffer-size 64 --batch-size 16)
declare -A ROWS=(
  [greedy]="--beam 1 --decoder greedy"
  [greedy-stream]="--beam 1 --decoder greedy-stream"
  [var-batch]="--beam 5 --decoder var-batch"
  [var-stream]="--beam 5 --decoder var-stream"
)
for run in $(seq "$REPEAT"); do
  for name in greedy greedy-stream var-batch var-stream; do
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 .venv/bin/fairseq-interactive "${COMMON[@]}" ${ROWS[$name]} < "$OUT/input.en" \
      > "$OUT/$name.out" 2> "$OUT/$name.err"
    echo "$name $run $(echo "$(date +%s.%N) - $start" | bc)" >> "$OUT/times.txt"
  done
done
.venv/bin/python - "$OUT" <<'PY'
import re, statistics, sys
out = sys.argv[1]
times = {}
for line in open(f"{out}/times.txt"):
    name, _, seconds = line.split()
    times.setdefault(name, []).append(float(seconds))
hyps = lambda name: re.findall(r"^H-(\d+)\t\S+\t(.*)$", open(f"{out}/{name}.out").read(), flags=re.M)
for fixed, live in (("greedy", "greedy-stream"), ("var-batch", "var-stream")):
    a, b = statistics.median(times[fixed]), statistics.median(times[live])
    same = sum(x == y for x, y in zip(hyps(fixed), hyps(live)))
    print(f"{fixed}: {a:.1f} s, {live}: {b:.1f} s ({a / b:.2f}x), identical hypotheses {same}/{len(hyps(fixed))}")
PY
