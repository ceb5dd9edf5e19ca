#!/usr/bin/env bash
# Cluster projection on a multilingual model (docs/benchmarks.md, "Multilingual models: one file per direction or
# per target language"): an English + Czech -> French transformer trained on
# Multi30k as fairseq trains multilingual models, the paper's Figure 2 per direction (largest and mean active
# share of the vocabulary for 100-500 clusters at K = 1, one file per direction vs one per target language),
# then fastgen-bench at beam 5, batch 64 with the chosen setting's directories (projection speedup, sentences/s
# ratio, identical outputs, BLEU difference). Resumable: each step is skipped when its output exists.
#
#   bash benchmarks/multilingual_clusters.sh [OUT_DIR] [options of benchmarks/multilingual_clusters.py]
#
# Defaults: bench_out/multilingual, the full corpus, 2,400 updates, 200,000 states per direction, clusters
# 100,200,300,400,500, the speed measured at 400 on the 1,000 sentences of test_2016_flickr, 1 thread, 3 timed
# passes. The tables are printed and written to OUT_DIR/report.md. A check of the whole pipeline at a tiny scale:
#
#   bash benchmarks/multilingual_clusters.sh /tmp/multilingual-tiny --max-train-lines 2000 --spm-vocab 1000 \
#       --max-update 5 --max-tokens 1024 --max-states 3000 --clusters 10,20 --chosen-clusters 20 \
#       --bench-sentences 16 --repeat 1
set -euo pipefail
OUT=${1:-bench_out/multilingual}
shift || true
exec .venv/bin/python benchmarks/multilingual_clusters.py --en-fr ../shared/data/multi30k-en-fr \
    --cs ../shared/data/multi30k-cs --out "$OUT" "$@"
