#!/usr/bin/env bash
# Every method at the base size (transformer_wmt_en_de shapes, 32k BPE vocabulary), beside CTranslate2 float32:
# the rows of docs/benchmarks.md, "Beside CTranslate2 (base size)" (the step engines), "At batch 1 (base size)" and
# "Relaxations (base size)" (blockwise) and "Base size (32k tokens)" (the cluster projection). One fastgen-bench run
# per row, its configurations measured in one process with interleaved passes, one thread; a row whose results.json
# exists is kept (rerun: delete its folder).
#
#   bash benchmarks/model_sizes.sh [MODEL_DIR] [OUT_DIR] [ROWS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (bin/, base/checkpoint_best.pt, khead4/, and the
# cluster files clusters1000k{3,12,15,20}.pt, made here when missing); defaults bench_out/multi30k-base, bench/sizes, every row.
# ROWS picks rows by name: "bs1 int8 students iteration narrow k8 kernel prefetch proposals bs64 beam5 screen clusters
# relaxed relaxed-compiled varbeam big". CTranslate2 joins when installed.
set -uo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/sizes}
ROWS=" ${3:-bs1 int8 students iteration narrow k8 kernel prefetch proposals bs64 beam5 screen clusters relaxed relaxed-compiled varbeam big} "
BASE=$M/base/checkpoint_best.pt
KHEAD=${KHEAD:-$M/khead4/checkpoint_last.pt}  # KHEAD=...: another student of the same base
export FASTGEN_COMPILED_DIR=${FASTGEN_COMPILED_DIR:-$OUT/compiled-steps}
source "$(dirname "$0")/bench_rows.sh"  # wanted, row, untrained
FROZEN=(--variant "frozen=--step-engine compiled --compiled-freezing")
# the model greedy runs beside a student: the base, or the student itself where its base was fine-tuned with it
greedy_beside() { if [[ $1 == *finetuned* ]]; then echo "$1"; else echo "$BASE"; fi; }

# greedy and blockwise (the frozen-base k = 4 student) at batch 1 on static and on the frozen compiled engine
wanted bs1 && row base-bs1 --path "$BASE" --khead-path "$KHEAD" --decoders greedy,blockwise --beam 1 --batch-size 1 \
  --max-sentences 100 --repeat 2 --reference greedy --step-engine static "${FROZEN[@]}"
# the same with the proposals of heads 2-4 from int8 copies of the heads and of the vocabulary projection (exact
# acceptance: greedy's tokens whatever the proposals)
wanted int8 && row base-blockwise-int8-bs1 --path "$BASE" --khead-path "$KHEAD" --decoders greedy,blockwise --beam 1 \
  --batch-size 1 --max-sentences 60 --repeat 2 --reference greedy --step-engine static --no-ctranslate2 \
  --variant "int8=--blockwise-int8-proposals" \
  --variant "frozen-int8=--step-engine compiled --compiled-freezing --blockwise-int8-proposals"
# each finished student of benchmarks/base_pipeline.sh (train.done beside it) at batch 1 beside greedy on its base (a
# fine-tuned student: on its own fine-tuned base, whose greedy tokens blockwise gives), on the frozen engine with int8
# proposals, with and without the screened projection (float32 greedy's tokens), and with --quantize int8 (int8
# greedy's tokens)
STUDENTS=${STUDENTS:-k4-frozen-distilled k4-frozen-then-finetuned-distilled-mean k4-frozen-distilled-ffn512
  k4-frozen-then-finetuned-distilled-mean-ffn512 k8-frozen-distilled-ffn512 k8-frozen-then-finetuned-distilled-mean-ffn512
  k8-frozen-distilled k8-frozen-then-finetuned-distilled-mean k4-frozen-then-finetuned-distilled-mean-first0.5-listed-ffn512
  k8-frozen-then-finetuned-distilled-mean-first0.5-listed-ffn512 k8-frozen-then-finetuned-distilled-mean-first0.5-listed}
# heads 2..k proposing among the 4,000 tokens most frequent in the training targets (--blockwise-proposal-vocab)
VOCAB=$M/proposal-vocab4000.txt
if wanted students; then
  [ -f "$VOCAB" ] || .venv/bin/python benchmarks/proposal_vocab.py "$M/bin" --top 4000 --output "$VOCAB"
  for STUDENT in $STUDENTS; do
    [ -f "$M/table1/$STUDENT/train.done" ] || { echo "== student $STUDENT: not trained yet"; continue; }
    STUDENT_PATH=$M/table1/$STUDENT/checkpoint_last.pt
    LISTED=()  # a student whose heads 2..k learned to choose among the list (-listed) proposes from it in every row
    [[ $STUDENT == *-listed* ]] && LISTED=(--blockwise-proposal-vocab "$VOCAB")
    row "student-$STUDENT-bs1" --path "$(greedy_beside "$STUDENT_PATH")" --khead-path "$STUDENT_PATH" \
      --decoders greedy,blockwise --beam 1 --batch-size 1 --max-sentences 100 --repeat 2 --reference greedy \
      --step-engine compiled --compiled-freezing --blockwise-int8-proposals --no-ctranslate2 "${LISTED[@]}" \
      --variant "screen=--screened-projection" --variant "int8=--quantize int8" \
      --variant "int8-vocab=--quantize int8 --blockwise-proposal-vocab $VOCAB"
  done
fi
# the cost of a blockwise iteration at batch 1, in greedy steps, on an untrained k = 4 student of the base shapes:
# its untrained heads repeat head 1's token, so it accepts about 3.7 tokens an iteration whatever it costs
UNTRAINED_KHEAD=$M/untrained-khead4/checkpoint_last.pt
# an untrained k = 4 student (identity head 1) at path $1, more fairseq-train options after it
untrained_student() { untrained transformer_khead "$1" --user-dir fairseq_fastgen --block-size 4 --khead-identity-first \
  --criterion random_subloss "${@:2}"; }
if wanted iteration; then
  untrained_student "$UNTRAINED_KHEAD"
  row untrained-blockwise-bs1 --path "$UNTRAINED_KHEAD" --decoders greedy,blockwise --beam 1 --batch-size 1 \
    --max-len-a 0 --max-len-b 25 --max-sentences 60 --repeat 3 --reference greedy --step-engine static \
    --no-ctranslate2 --blockwise-int8-proposals "${FROZEN[@]}"
fi
# the same untrained student beside one whose k-head layer is a quarter as wide (--khead-ffn-dim 512: 4.2M parameters
# against 16.8M), both accepting 3.71 tokens an iteration, on the frozen engine and with --quantize int8
UNTRAINED_NARROW=$M/untrained-khead4-ffn512/checkpoint_last.pt
if wanted narrow; then
  untrained_student "$UNTRAINED_KHEAD"
  untrained_student "$UNTRAINED_NARROW" --khead-ffn-dim 512
  for WIDTH in wide narrow; do
    STUDENT_PATH=$UNTRAINED_KHEAD; [ $WIDTH = narrow ] && STUDENT_PATH=$UNTRAINED_NARROW
    row "untrained-khead-$WIDTH-bs1" --path "$STUDENT_PATH" --decoders greedy,blockwise --beam 1 --batch-size 1 \
      --max-len-a 0 --max-len-b 25 --max-sentences 60 --repeat 3 --reference greedy --step-engine compiled \
      --compiled-freezing --no-ctranslate2 --blockwise-int8-proposals --variant "int8=--quantize int8"
  done
fi
# k = 8: an untrained narrow student whose block unit verifies 8 positions, 8 rows of the float32 kernel that read
# each weight once (its heads repeat head 1's token: up to 8 tokens an iteration, outputs capped at 25)
UNTRAINED_K8=$M/untrained-khead8-ffn512/checkpoint_last.pt
if wanted k8; then
  untrained_student "$UNTRAINED_K8" --khead-ffn-dim 512 --block-size 8
  row untrained-k8-narrow-bs1 --path "$UNTRAINED_K8" --decoders greedy,blockwise --beam 1 --batch-size 1 \
    --max-len-a 0 --max-len-b 25 --max-sentences 60 --repeat 3 --reference greedy --step-engine compiled \
    --compiled-freezing --no-ctranslate2 --blockwise-int8-proposals
fi
# the kernels' prefetches of the weights into the L2 cache (T1, the default) and into the L1 (T0): the narrow untrained
# student, float32 and int8, one process a hint, alternating
if wanted prefetch; then
  untrained_student "$UNTRAINED_NARROW" --khead-ffn-dim 512
  for RUN in 1 2; do
    for HINT in T1 T0; do
      FASTGEN_PREFETCH_HINT=$HINT row "untrained-narrow-prefetch$HINT-run$RUN-bs1" --path "$UNTRAINED_NARROW" \
        --decoders greedy,blockwise --beam 1 --batch-size 1 --max-len-a 0 --max-len-b 25 --max-sentences 60 \
        --repeat 3 --reference greedy --step-engine compiled --compiled-freezing --no-ctranslate2 \
        --blockwise-int8-proposals --variant "int8=--quantize int8"
    done
  done
fi
# what the float32 kernel of a few rows (kernels/f32_rows_cpu.cpp) brings to the frozen units, the narrow untrained
# student in float32: with it, and with FASTGEN_F32_ROWS=0 (inductor's C++ template or oneDNN in the units), each in
# its own processes (two of each, alternating; its own folder of units each)
if wanted kernel; then
  untrained_student "$UNTRAINED_NARROW" --khead-ffn-dim 512
  for RUN in 1 2; do
    for F32_ROWS in 1 0; do
      FASTGEN_F32_ROWS=$F32_ROWS FASTGEN_COMPILED_DIR=$OUT/compiled-steps-f32rows$F32_ROWS \
        row "untrained-narrow-f32rows$F32_ROWS-run$RUN-bs1" --path "$UNTRAINED_NARROW" --decoders greedy,blockwise \
        --beam 1 --batch-size 1 --max-len-a 0 --max-len-b 25 --max-sentences 60 --repeat 3 --reference greedy \
        --step-engine compiled --compiled-freezing --no-ctranslate2 --blockwise-int8-proposals
    done
  done
fi
# what --blockwise-proposal-vocab saves an iteration (int8, the narrow untrained student): the list holds the 4,000
# tokens most frequent in the training targets and every token the untrained model writes, so that it accepts about
# as many tokens an iteration with the list as without
if wanted proposals; then
  untrained_student "$UNTRAINED_NARROW" --khead-ffn-dim 512
  WRITTEN=$OUT/untrained-narrow-greedy.txt
  [ -s "$WRITTEN" ] || .venv/bin/fairseq-generate "$M/bin" --path "$UNTRAINED_NARROW" --user-dir fairseq_fastgen --cpu \
    --gen-subset test --beam 1 --decoder greedy --batch-size 64 --max-len-a 0 --max-len-b 25 > "$WRITTEN" 2>/dev/null
  UNTRAINED_VOCAB=$OUT/proposal-vocab4000-untrained.txt
  [ -f "$UNTRAINED_VOCAB" ] || .venv/bin/python benchmarks/proposal_vocab.py "$M/bin" --top 4000 \
    --output "$UNTRAINED_VOCAB" --also "$WRITTEN"
  row untrained-proposal-vocab-bs1 --path "$UNTRAINED_NARROW" --decoders greedy,blockwise --beam 1 --batch-size 1 \
    --max-len-a 0 --max-len-b 25 --max-sentences 60 --repeat 3 --reference greedy --step-engine compiled --compiled-freezing \
    --no-ctranslate2 --blockwise-int8-proposals --quantize int8 \
    --variant "vocab4000=--blockwise-proposal-vocab $UNTRAINED_VOCAB"
fi
# greedy at batch 64, every sentence of test_2016_flickr
wanted bs64 && row base-greedy-bs64 --path "$BASE" --decoders greedy --beam 1 --batch-size 64 --repeat 3 \
  --reference greedy --step-engine static "${FROZEN[@]}"
# stock beam 5 at batch 64: fairseq's own step, and the compiled engine (stock's hypotheses)
wanted beam5 && row base-beam5-bs64 --path "$BASE" --decoders beam --beam 5 --batch-size 64 --max-sentences 300 \
  --repeat 3 --step-engine fairseq --variant "compiled=--step-engine compiled"
# blockwise's relaxations (the paper's Table 1 / Figure 3 trade-off), int8 proposals: top-k acceptance, a minimum block
# (beside greedy on the student's base: its own where it was fine-tuned); row $1 on the engine options after it
relaxed_row() {
  row "$1" --path "$(greedy_beside "$KHEAD")" --khead-path "$KHEAD" --decoders greedy,blockwise --beam 1 \
    --batch-size 1 --max-sentences 60 --repeat 2 --reference greedy "${@:2}" --no-ctranslate2 \
    --blockwise-int8-proposals --variant "top2=--blockwise-top-k 2" --variant "top3=--blockwise-top-k 3" \
    --variant "minblock2=--blockwise-min-block 2"
}
wanted relaxed && relaxed_row base-blockwise-relaxed --step-engine static
# the same on the frozen compiled engine (where an iteration costs fewer greedy steps)
wanted relaxed-compiled && relaxed_row base-blockwise-relaxed-compiled --step-engine compiled --compiled-freezing
# the vocabulary projection screened in int8 (float32's best tokens; greedy's are float32's), beside the same engines
# without it and CTranslate2 float32: greedy at batch 1 and 64, stock beam 5 at batch 64
SCREEN="--screened-projection"
wanted screen && row base-screen-bs1 --path "$BASE" --decoders greedy --beam 1 --batch-size 1 --max-sentences 300 \
  --repeat 2 --reference greedy --step-engine static --variant "screen=$SCREEN" "${FROZEN[@]}" \
  --variant "frozen-screen=--step-engine compiled --compiled-freezing $SCREEN"
wanted screen && row base-screen-bs64 --path "$BASE" --decoders greedy --beam 1 --batch-size 64 --repeat 3 \
  --reference greedy --step-engine compiled --compiled-freezing --variant "screen=$SCREEN"
wanted screen && row base-screen-beam5 --path "$BASE" --decoders beam --beam 5 --batch-size 64 --max-sentences 300 \
  --repeat 3 --step-engine compiled --variant "screen=$SCREEN" --variant "frozen-screen=--compiled-freezing $SCREEN"
# the cluster-projected vocabulary: 1,000 clusters of 100,000 decoder states of train, teacher-forced, each cluster's
# active set the top 3 (fastgen-train-clusters' default) and the top 20 tokens of its member states, each state on its
# nearest cluster and (n2, n3) on its 2 or 3 nearest (--cluster-nearest); each row beside the same decoder on the same
# engine without it (--reference self): greedy at batch 1 on the default engine's units, stock beam 5 at batch 64 on
# the compiled engine, and there --cluster-union-normalizer (the softmax over the active tokens, without the file's
# estimate of the mass outside them) and --cluster-full-normalizer (the file's tokens, the whole vocabulary's softmax:
# which outputs change because of the normaliser alone). A file made before the estimate is used as it is (one line
# says so); remove it to have it made again. Between the two, the top 12 and 15 (155 and 192 tokens a cluster) at beam 5
if wanted clusters; then
  for TOP in 3 12 15 20; do
    FILE=$M/clusters1000k$TOP.pt
    [ -f "$FILE" ] || .venv/bin/fastgen-train-clusters "$M/bin" --path "$BASE" --output "$FILE" --num-clusters 1000 \
      --top-k $TOP --max-states 100000 --cpu > "$OUT/clusters-k$TOP.log" 2>&1 || tail -5 "$OUT/clusters-k$TOP.log"
  done
  K3=$M/clusters1000k3.pt K12=$M/clusters1000k12.pt K15=$M/clusters1000k15.pt K20=$M/clusters1000k20.pt
  BEAM5=(--path "$BASE" --decoders beam --beam 5 --batch-size 64 --max-sentences 192 --repeat 2 --reference self
         --step-engine compiled --no-ctranslate2)
  CP=(--variant "k3=--cluster-projection $K3" --variant "k3n3=--cluster-projection $K3 --cluster-nearest 3"
      --variant "k20=--cluster-projection $K20" --variant "k20n2=--cluster-projection $K20 --cluster-nearest 2")
  row base-clusters-bs1 --path "$BASE" --decoders greedy --beam 1 --batch-size 1 --max-sentences 100 --repeat 2 \
    --reference self --step-engine compiled --compiled-freezing --no-ctranslate2 "${CP[@]}"
  row base-clusters-beam5-bs64 "${BEAM5[@]}" "${CP[@]}" \
    --variant "k20union=--cluster-projection $K20 --cluster-union-normalizer" \
    --variant "k20full=--cluster-projection $K20 --cluster-full-normalizer"
  row base-clusters-k12-beam5-bs64 "${BEAM5[@]}" --variant "k12=--cluster-projection $K12" \
    --variant "k15=--cluster-projection $K15"
fi
# variable-width beams (var-batch) and their stream (var-stream, var-batch's outputs) beside stock beam search at
# beam 5 and 20, batch 64
wanted varbeam && row base-var-beam-bs64 --path "$BASE" --decoders beam,var-batch,var-stream --beam 5,20 \
  --batch-size 64 --max-sentences 192 --repeat 2 --step-engine static --no-ctranslate2
# the big shapes, untrained (one update at a learning rate of 1e-9, made here when missing; outputs capped at 25
# tokens): speed only, greedy at batch 1 and 64, on static and on the frozen compiled engine, and stock beam 5
BIG=${BIG:-bench_out/multi30k-big/untrained/checkpoint_last.pt}  # not base/: base_pipeline.sh trains the big model there
if wanted big; then
  untrained transformer_vaswani_wmt_en_de_big "$BIG"
  for BATCH in 1 64; do
    row "big-greedy-bs$BATCH" --path "$BIG" --decoders greedy --beam 1 --batch-size "$BATCH" --max-len-a 0 \
      --max-len-b 25 --max-sentences $((BATCH == 1 ? 30 : 128)) --repeat 2 --reference greedy --step-engine static \
      "${FROZEN[@]}"
  done
  # stock beam 5 at batch 64 (one batch): fairseq's own step, the compiled engine as the base row beam5, and the
  # frozen compiled engine (what the default engine runs)
  row big-beam5-bs64 --path "$BIG" --decoders beam --beam 5 --batch-size 64 --max-len-a 0 --max-len-b 25 \
    --max-sentences 64 --repeat 2 --step-engine fairseq --variant "compiled=--step-engine compiled" "${FROZEN[@]}"
fi
