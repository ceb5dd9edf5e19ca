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
# 5. the same as whole fairseq-generate processes at beam 4, stock fairseq-generate beside the plugin (about 25 s a
#    process on an H100 machine, 12 processes; session 15 ran out of GPU time here, so this step has no figures yet).
set -u -o pipefail
DATA=$1 KHEAD=$2 STOCK=$3 OUT=$4
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
echo "== 1. kernel tests on the GPU"
$PYTHON -m pytest tests/ops -q -rs -p no:cacheprovider 2>&1 | tail -3
echo "== 2. compute-sanitizer over the GPU kernel tests"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool $PYTHON -m pytest tests/ops -q -k gpu -p no:cacheprovider 2>&1 | grep "passed\|SUMMARY"
done
echo "== 3. blockwise vs greedy at batch 1"
$PYTHON -m fairseq_fastgen.bench "$DATA" --path "$KHEAD" --decoders greedy,blockwise --beam 1 --batch-size 1 \
  --repeat 5 --max-sentences 300 --no-ctranslate2 --post-process sentencepiece --output-dir "$OUT/blockwise" \
  > "$OUT/blockwise.log" 2>&1
grep "^|" "$OUT/blockwise.log"
echo "== 4. beam search, each optimization off"
$PYTHON -m fairseq_fastgen.bench "$DATA" --path "$STOCK" --decoders beam --beam 4,5 --batch-size 64 --repeat 3 \
  --no-repeat-ngram-size 3 --post-process sentencepiece --no-ctranslate2 --variant 'copies=--no-shared-encoder-cache' \
  --variant 'stockloop=--no-lean-beam-loop' --variant 'alloff=--no-shared-encoder-cache --no-lean-beam-loop --no-inference-mode' \
  --output-dir "$OUT/beam" > "$OUT/beam.log" 2>&1
grep "^|" "$OUT/beam.log"
echo "== 5. whole processes: stock fairseq-generate and the plugin, beam 4"
$PYTHON -m fairseq_fastgen.bench "$DATA" --path "$STOCK" --whole-process --decoders beam --beam 4 --batch-size 64 \
  --repeat 2 --no-repeat-ngram-size 3 --post-process sentencepiece --variant 'copies=--no-shared-encoder-cache' \
  --variant 'stockloop=--no-lean-beam-loop' --output-dir "$OUT/whole-process" > "$OUT/whole-process.log" 2>&1
grep "^|" "$OUT/whole-process.log"
