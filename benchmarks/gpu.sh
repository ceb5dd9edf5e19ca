#!/usr/bin/env bash
# What only a GPU shows (not part of the product). Run from the repository root on a CUDA machine whose python
# has torch, CuPy and fairseq-fixed (e.g. `make venv` there, then `pip install cupy-cuda12x` or the CuPy of its CUDA):
#
#   bash benchmarks/gpu.sh DATA_BIN KHEAD_CHECKPOINT STOCK_CHECKPOINT OUT_DIR
#
# 1. tests/ops on the GPU: every CuPy kernel (n-gram banning, cache reorder and shrink, cluster union) against its
#    torch reference on CUDA tensors, beside the CPU tests of the same ops;
# 2. compute-sanitizer memcheck and racecheck over the GPU kernel tests;
# 3. blockwise against greedy decoding of the same k-head model at batch 1 (300 sentences, 5 timed passes);
# 4. beam search at beam 4 and 5, batch 64, --no-repeat-ngram-size 3: the plugin's optimizations on, each off, all
#    off (identical outputs, speed, peak CUDA memory).
# 5. the same as whole fairseq-generate processes at beam 4, stock fairseq-generate beside the plugin (12 processes).
# 6. the decoder-step engines on CUDA (--step-engine fairseq / static / compiled, CUDA graphs): the cost of one step
#    per row count, then greedy at batch 1 (200 sentences) and 64, stock beam 5 at batch 64, blockwise beside
#    greedy at batch 1 on the static and compiled engines;
# 7. streaming at capacity 64: greedy and blockwise beside their streamed forms (at their defaults: refills in
#    finished rows' places as rows finish on static, greedy-stream's cohorts on fairseq), var-batch beside var-stream
#    (min-length, fifo, a budget of rows) at beam 20, 300 sentences, on the static and fairseq engines; greedy beside
#    greedy-stream --stream-join-lengths (refills as rows finish) on the static and compiled engines.
# 8. the base-size models (benchmarks/multi30k.py --size base: transformer_wmt_en_de shapes, 32k BPE), built on the
#    GPU where missing (its data-bin travels from the CPU machine, SIZES_DIR, default bench_out/multi30k-base): the
#    base trained with --amp, rounded to int8 rows (benchmarks/int8_transport.py, so that the CPU machine gets it back
#    in parts of 16 MiB under SIZES_DIR/transport), a frozen-base k = 4 student trained on the rounded base, its heads
#    packed too; the base's BLEU on test_2016_flickr (beam 5);
# 9. the base-size models on CUDA: greedy and blockwise at batch 1 (300 sentences) on the static and compiled engines,
#    greedy at batch 64 and stock beam 5 at batch 64 on fairseq's step and the compiled engine.
# STEPS="6 7" runs only those steps (default: 1-7); KHEAD may be "-" where no k-head student travelled (the
# blockwise rows are left out). Steps 8 and 9 read only SIZES_DIR: `STEPS="8 9" bash benchmarks/gpu.sh - - - OUT`.
set -u -o pipefail
DATA=$1 KHEAD=$2 STOCK=$3 OUT=$4
PYTHON=${PYTHON:-python3}
STEPS=" ${STEPS:-1 2 3 4 5 6 7} "
SIZES_DIR=${SIZES_DIR:-bench_out/multi30k-base}
mkdir -p "$OUT"
step() { [[ "$STEPS" == *" $1 "* ]]; }
# one fastgen-bench run: its table rows and, if it failed, the end of its log
bench() {
  local name=$1; shift
  $PYTHON -m fairseq_fastgen.bench "$DATA" --post-process sentencepiece --output-dir "$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1 || tail -5 "$OUT/$name.log"
  grep "^|" "$OUT/$name.log"
}
if step 1; then
echo "== 1. kernel tests on the GPU"
$PYTHON -m pytest tests/ops -q -rs -p no:cacheprovider 2>&1 | tail -3
fi
if step 2; then
echo "== 2. compute-sanitizer over the GPU kernel tests"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool $PYTHON -m pytest tests/ops -q -k gpu -p no:cacheprovider 2>&1 | grep "passed\|SUMMARY"
done
fi
if step 3; then
echo "== 3. blockwise vs greedy at batch 1"
$PYTHON -m fairseq_fastgen.bench "$DATA" --path "$KHEAD" --decoders greedy,blockwise --beam 1 --batch-size 1 \
  --repeat 5 --max-sentences 300 --no-ctranslate2 --post-process sentencepiece --output-dir "$OUT/blockwise" \
  > "$OUT/blockwise.log" 2>&1
grep "^|" "$OUT/blockwise.log"
fi
if step 4; then
echo "== 4. beam search, each optimization off"
$PYTHON -m fairseq_fastgen.bench "$DATA" --path "$STOCK" --decoders beam --beam 4,5 --batch-size 64 --repeat 3 \
  --no-repeat-ngram-size 3 --post-process sentencepiece --no-ctranslate2 --variant 'copies=--no-shared-encoder-cache' \
  --variant 'stockloop=--no-lean-beam-loop' --variant 'alloff=--no-shared-encoder-cache --no-lean-beam-loop --no-inference-mode' \
  --output-dir "$OUT/beam" > "$OUT/beam.log" 2>&1
grep "^|" "$OUT/beam.log"
fi
if step 5; then
echo "== 5. whole processes: stock fairseq-generate and the plugin, beam 4"
$PYTHON -m fairseq_fastgen.bench "$DATA" --path "$STOCK" --whole-process --decoders beam --beam 4 --batch-size 64 \
  --repeat 2 --no-repeat-ngram-size 3 --post-process sentencepiece --variant 'copies=--no-shared-encoder-cache' \
  --variant 'stockloop=--no-lean-beam-loop' --output-dir "$OUT/whole-process" > "$OUT/whole-process.log" 2>&1
grep "^|" "$OUT/whole-process.log"
fi
ENGINES=(--step-engine fairseq --variant "static=--step-engine static" --variant "compiled=--step-engine compiled")
if step 6; then
echo "== 6. the decoder-step engines on CUDA"
$PYTHON benchmarks/decoder_step_cost.py --path "$STOCK" --data "$DATA" --device cuda --rows 1,8,64,320 --rounds 5 \
  --engines fairseq,static,compiled 2>&1 | grep -v "^INFO\|^DEBUG\|Warning"
bench engine-greedy-bs1 --path "$STOCK" --decoders greedy --beam 1 --batch-size 1 --max-sentences 200 --repeat 3 \
  --reference greedy "${ENGINES[@]}"
bench engine-greedy-bs64 --path "$STOCK" --decoders greedy --beam 1 --batch-size 64 --repeat 3 --reference greedy \
  "${ENGINES[@]}"
bench engine-beam5-bs64 --path "$STOCK" --decoders beam --beam 5 --batch-size 64 --repeat 3 --step-engine fairseq \
  --variant "compiled=--step-engine compiled"
if [ "$KHEAD" != "-" ]; then
  bench engine-blockwise-bs1 --path "$STOCK" --khead-path "$KHEAD" --decoders greedy,blockwise --beam 1 --batch-size 1 \
    --max-sentences 200 --repeat 3 --reference greedy --no-ctranslate2 --step-engine static \
    --variant "compiled=--step-engine compiled"
fi
fi
if step 7; then
echo "== 7. streaming at capacity 64"
for ENGINE in static fairseq; do
  bench "stream-beam20-$ENGINE" --path "$STOCK" --decoders var-batch,var-stream --beam 20 --batch-size 64 \
    --max-sentences 300 --repeat 3 --reference var-batch --step-engine $ENGINE --no-ctranslate2 \
    --variant "fifo=--stream-selection fifo" --variant "budget=--stream-capacity-rows 1280"
  bench "stream-greedy-$ENGINE" --path "$STOCK" --decoders greedy,greedy-stream --beam 1 --batch-size 64 --repeat 3 \
    --reference greedy --step-engine $ENGINE --no-ctranslate2
  if [ "$KHEAD" != "-" ]; then
    bench "stream-blockwise-$ENGINE" --path "$STOCK" --khead-path "$KHEAD" --decoders blockwise,blockwise-stream \
      --beam 1 --batch-size 64 --repeat 3 --reference blockwise --step-engine $ENGINE --no-ctranslate2
  fi
done
# refills as rows finish, a refill's rows in finished rows' places, each row at its own position (static, compiled)
bench stream-greedy-joined --path "$STOCK" --decoders greedy,greedy-stream --beam 1 --batch-size 64 --repeat 3 \
  --reference greedy --step-engine static --no-ctranslate2 --stream-join-lengths --stream-eps 0.984375 \
  --variant "compiled=--step-engine compiled"
fi
if step 8; then
echo "== 8. the base-size models, built where missing"
M=$SIZES_DIR
$PYTHON benchmarks/multi30k.py --size base --out "$M" --stop-after base --device cuda > "$OUT/size-base-train.log" 2>&1 \
  || tail -20 "$OUT/size-base-train.log"
grep -E "valid \| epoch|done in" "$OUT/size-base-train.log" | tail -4
if [ ! -e "$M/transport/base.meta.pt" ]; then  # the base from here on is its int8 rounding, as the CPU gets it
  $PYTHON benchmarks/int8_transport.py pack "$M/base/checkpoint_best.pt" "$M/transport" base
  mv "$M/base/checkpoint_best.pt" "$M/base/checkpoint_trained.pt"
  $PYTHON benchmarks/int8_transport.py unpack "$M/transport" base "$M/base/checkpoint_best.pt"
fi
$PYTHON -m fairseq_cli.generate "$M/bin" --user-dir fairseq_fastgen --path "$M/base/checkpoint_best.pt" --beam 5 \
  --batch-size 128 --post-process sentencepiece --quiet 2>&1 | grep "BLEU" | sed "s/^/base (int8-rounded) /"
$PYTHON benchmarks/multi30k.py --size base --out "$M" --stop-after khead --khead-k 4 --khead-updates 800 \
  --device cuda > "$OUT/size-khead-train.log" 2>&1 || tail -20 "$OUT/size-khead-train.log"
[ -e "$M/transport/khead4.meta.pt" ] || $PYTHON benchmarks/int8_transport.py pack "$M/khead4/checkpoint_last.pt" \
  "$M/transport" khead4 --only-prefix decoder.heads.
fi
if step 9; then
echo "== 9. the base-size models on CUDA"
M=$SIZES_DIR
bench size-base-bs1 --path "$M/base/checkpoint_best.pt" --khead-path "$M/khead4/checkpoint_last.pt" \
  --decoders greedy,blockwise --beam 1 --batch-size 1 --max-sentences 300 --repeat 3 --reference greedy \
  --no-ctranslate2 --step-engine static --variant "compiled=--step-engine compiled"
bench size-base-greedy-bs64 --path "$M/base/checkpoint_best.pt" --decoders greedy --beam 1 --batch-size 64 \
  --repeat 3 --reference greedy --no-ctranslate2 "${ENGINES[@]}"
bench size-base-beam5-bs64 --path "$M/base/checkpoint_best.pt" --decoders beam --beam 5 --batch-size 64 --repeat 3 \
  --no-ctranslate2 --step-engine fairseq --variant "compiled=--step-engine compiled"
fi
