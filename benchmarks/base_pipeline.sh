#!/usr/bin/env bash
# Every base-size model the benchmarks read, one after another, unattended (not part of the product).
#
#   bash benchmarks/base_pipeline.sh [M] [BENCH]     # M: bench_out/multi30k-base, BENCH: bench/base-students
#
# Each step is skipped when its output exists and a stopped step resumes from its last checkpoint, so the same
# command picks up wherever a previous run (or a lost machine) left off. On the 2-core Intel Xeon (bfloat16 on AMX)
# the base takes about 3.5 hours (1,200 updates of ~10 s), a frozen student's update ~8 s and a fine-tuned one's ~25 s
# (mean mode scores every head; at k = 8 the listed heads keep it near that, against ~45 s with the whole
# vocabulary), so the base-size chain runs about 20 hours and the big model about a day more; run
# it under `nice -n 19` so that interactive work comes first, and stop it (kill -STOP, kill -CONT) while timing
# anything else.
#
# In order, each needing the ones before:
#   1. the base transformer (benchmarks/multi30k.py --size base), BLEU of its checkpoint_best.pt in base/bleu.txt;
#   2. the cluster files of model_sizes.sh's "clusters" rows (1,000 clusters, top 3 and top 20 tokens), then the
#      trained base's figures on this machine (benchmarks/trained_base_figures.sh, about two hours: each row alone on
#      the machine; leave it to itself while it runs);
#   3. the base's beam-5 translations of the training split (fastgen-distill, int8 teacher on the compiled engine);
#   4. for k = 8, then 4: a frozen-base student on the distilled data, then the same student fine-tuned whole
#      (the two stages of docs/benchmarks.md, "The students"; the second with heads 2..k choosing among a list of
#      4,000 tokens, benchmarks/proposal_vocab.py, and half the loss on head 1: names ending
#      -first0.5-listed), first with a k-head layer a quarter as wide
#      (--khead-ffn-dim 512: an iteration reads 4.2M parameters of it instead of 16.8M; the narrow students gave the
#      best blockwise figures, and k = 8 is the one that can accept more than 4 tokens an iteration), then the wide;
#      after the narrow k = 8 pair a narrow frozen k = 8 one on the base's greedy translations (multi30k_distill.py's
#      "greedy")
#   5. the frozen-base k = 4 student on the regular data (model_sizes.sh's default KHEAD);
#   6. multi30k_distill.py's "bench" stage: BLEU and the mean accepted block of every model (batch 64, not timed);
#   7. the big transformer (benchmarks/multi30k.py --size big, 2,400 updates: about 4x the base's time an update
#      here) and its BLEU, in bench_out/multi30k-big (BIG_OUT), after everything the base-size rows need.
set -euo pipefail
# the whole script is one block, read before it runs: an edit to this file while a run is under way (they last a day)
# does not shift what the running shell reads next
{
# nice alone does not yield to other sessions' work where the kernel groups processes by session (autogroup: a chain
# started with setsid, as it should be to outlive its terminal, weighs as much as everything else): its group too
echo 19 2>/dev/null > /proc/self/autogroup || true
# glibc serves buffers above 32 MiB with fresh pages that fault on first touch: fairseq-train on the CPU spent 40% of
# its CPU time in the kernel. From the heap (as the plugin's generators take them: fairseq_fastgen/ops/heap.py) less,
# but a base update frees 4-5 GB at the heap's top, which glibc hands back above its trim threshold and faults in
# again (brk shrinking and growing by GBs each update: 12% of the base's time in the kernel at a 2 GiB threshold);
# a threshold above the heap's peak (about 10 GB for the base) keeps those pages.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1073741824} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
M=${1:-bench_out/multi30k-base}
BENCH=${2:-bench/base-students}
PY=.venv/bin/python
BASE=$M/base/checkpoint_best.pt
# heads 2..k of the fine-tuned students learn to choose among the 4,000 tokens most frequent in the training targets,
# the list they propose from when decoding (--blockwise-proposal-vocab): at k = 8 an update takes a third of the time;
# head 1 (the model's own prediction) keeps half the loss: with 1/8 of it (the plain mean) the k = 8 student's base
# lost 6 BLEU on 100 test sentences in 220 updates (34.05 against 40.12 greedy)
VOCAB=$M/proposal-vocab4000.txt
STUDENTS=(--size base --out "$M" --bench-dir "$BENCH" --k 4,8 --frozen-lr 0.001 --student-updates 400
          --finetune-subloss-mode mean --finetune-lr 0.0002 --finetune-updates 600 --finetune-proposal-vocab "$VOCAB"
          --finetune-first-head-weight 0.5)

say() { echo "== $(date -u '+%F %T') $*"; }
# the BLEU of the model trained in $1 (its base/checkpoint_best.pt; beam 5, test_2016_flickr), in $1/base/bleu.txt
bleu() {
  if [ ! -f "$1/base/bleu.txt" ]; then
    say "BLEU of $1/base (beam 5, test_2016_flickr)"
    .venv/bin/fairseq-generate "$1/bin" --path "$1/base/checkpoint_best.pt" --user-dir fairseq_fastgen --cpu \
      --gen-subset test --beam 5 --batch-size 64 --post-process sentencepiece --scoring sacrebleu --quiet 2>&1 \
      | tail -1 > "$1/base/bleu.txt"
  fi
  cat "$1/base/bleu.txt"
}

say "base transformer"
"$PY" benchmarks/multi30k.py --size base --out "$M" --stop-after base
bleu "$M"
for TOP in 3 20; do
  FILE=$M/clusters1000k$TOP.pt
  if [ ! -f "$FILE" ]; then
    say "cluster file $FILE"
    .venv/bin/fastgen-train-clusters "$M/bin" --path "$BASE" --output "$FILE" --num-clusters 1000 --top-k $TOP \
      --max-states 100000 --cpu
  fi
done
say "the trained base's figures"
bash benchmarks/trained_base_figures.sh "$M" || true
say "distilled training data"
"$PY" benchmarks/multi30k_distill.py "${STUDENTS[@]}" --stages distill \
  --teacher-args "--quantize int8 --step-engine compiled"
[ -f "$VOCAB" ] || "$PY" benchmarks/proposal_vocab.py "$M/bin" --top 4000 --output "$VOCAB"
# k = K students, frozen then fine-tuned, distilled data; "--khead-ffn-dim N" after K names them -ffnN
students() {
  local K=$1 suffix=""
  shift
  if [ $# -gt 0 ]; then suffix="-ffn$2"; fi
  say "k = $K students (frozen, then fine-tuned), distilled data $*"
  "$PY" benchmarks/multi30k_distill.py "${STUDENTS[@]}" --stages students --students "k$K-frozen-distilled$suffix" \
    --two-stage "$K-distilled" "$@"
}
# first the narrow k = 8 student frozen, then fine-tuned whole: the one that can accept more than the 2.6 tokens an
# iteration of the fine-tuned narrow k = 4 (docs/benchmarks.md, "At batch 1"), which blockwise's 2x needs
students 8 --khead-ffn-dim 512
# the narrow frozen k = 8 student on the base's own greedy translations (the tokens exact acceptance checks a frozen
# base's heads against; made from the base in float32), beside the same student on the distilled data
say "k = 8 frozen student, greedy data --khead-ffn-dim 512"
"$PY" benchmarks/multi30k_distill.py "${STUDENTS[@]}" --stages students --khead-ffn-dim 512 \
  --students k8-frozen-greedy-ffn512
students 4 --khead-ffn-dim 512
students 8
students 4
say "k = 4 frozen student, regular data"
"$PY" benchmarks/multi30k.py --size base --out "$M" --stop-after khead --khead-k 4 --khead-updates 800
say "BLEU and accepted blocks"
"$PY" benchmarks/multi30k_distill.py "${STUDENTS[@]}" --stages bench --two-stage 4-distilled,8-distilled
"$PY" benchmarks/multi30k_distill.py "${STUDENTS[@]}" --stages bench --two-stage 4-distilled,8-distilled --khead-ffn-dim 512
BIG_OUT=${BIG_OUT:-bench_out/multi30k-big}
say "big transformer"
"$PY" benchmarks/multi30k.py --size big --out "$BIG_OUT" --stop-after base
bleu "$BIG_OUT"
say "done"
exit
}
