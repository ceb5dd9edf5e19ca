# Sourced by the benchmark scripts that run one fastgen-bench per table row (model_sizes.sh, precision.sh).
# They set M (the model directory: bin/ is the data-bin), OUT (where each row's folder goes) and ROWS (the names of
# the rows asked for, space-separated, with a space at each end).
mkdir -p "$OUT"
# whether row $1 was asked for
wanted() { [[ "$ROWS" == *" $1 "* ]]; }
# one fastgen-bench row into OUT/NAME (skipped when its results.json exists), one thread, its table printed
row() {
  local name=$1; shift
  if [ ! -f "$OUT/$name/results.json" ]; then
    .venv/bin/fastgen-bench "$M/bin" --cpu --threads 1 --post-process sentencepiece --output-dir "$OUT/$name" "$@" \
      > "$OUT/$name.log" 2>&1 || { tail -5 "$OUT/$name.log"; return; }
  fi
  echo "== $name"; grep "^|" "$OUT/$name/results.md"
}
