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
# an untrained checkpoint of fairseq architecture $1 at path $2 (one update at a learning rate of 1e-9), made when
# missing: the shapes for speed rows where training takes hours on the CPU (outputs capped with --max-len-b); more
# fairseq-train options may follow (the last of an option given twice wins)
untrained() {
  local arch=$1 path=$2
  shift 2
  [ -f "$path" ] || .venv/bin/python -m fairseq_cli.train "$M/bin" --arch "$arch" --share-all-embeddings \
    --max-source-positions 256 --max-target-positions 256 --optimizer adam --lr 1e-9 --lr-scheduler fixed \
    --max-tokens 256 --max-update 1 --disable-validation --cpu --num-workers 0 --save-dir "$(dirname "$path")" \
    --no-epoch-checkpoints --no-save-optimizer-state --criterion label_smoothed_cross_entropy "$@" \
    > "$OUT/untrained-$arch.log" 2>&1 || tail -5 "$OUT/untrained-$arch.log"
}
