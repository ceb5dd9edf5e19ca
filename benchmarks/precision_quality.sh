#!/usr/bin/env bash
# The quality of --quantize over a whole test split (test_2016_flickr: 1,000 sentences): BLEU (sacrebleu on the
# detokenized D- lines against the T- references) and the share of sentences given float32's tokens, for greedy
# and stock beam 5 at batch 64, each precision (int8 also with its vocabulary projection in float32) in one
# fairseq-generate process on --step-engine static (the arithmetic the other engines are held to). Only quality:
# one pass each, no timing (fastgen-bench's rows, benchmarks/precision.sh, measure speed). A process whose output
# is complete is kept (rerun: delete it).
#
#   bash benchmarks/precision_quality.sh [MODEL_DIR] [OUT_DIR] [THREADS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (default bench_out/multi30k-base; out
# bench/precision-quality; 2 threads). BASE overrides the checkpoint (default MODEL_DIR/base/checkpoint_best.pt),
# SUBSET the split (test), EXTRA adds options to every process.
set -euo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/precision-quality}
export OMP_NUM_THREADS=${3:-2}
BASE=${BASE:-$M/base/checkpoint_best.pt}
read -r -a EXTRA_OPTIONS <<< "${EXTRA:-}"
mkdir -p "$OUT"
declare -A SEARCH=([greedy]="--decoder greedy --beam 1" [beam5]="--beam 5")
declare -A PRECISION=([float32]="" [int8]="--quantize int8" [int8-f32vocab]="--quantize int8 --float32-vocabulary-projection"
                      [bf16]="--quantize bf16")
for search in greedy beam5; do
  for precision in float32 int8 int8-f32vocab bf16; do
    out=$OUT/$search-$precision.out
    grep -q "^Generate " "$out" 2> /dev/null && continue
    read -r -a options <<< "${SEARCH[$search]} ${PRECISION[$precision]}"
    echo "== $search $precision"
    .venv/bin/fairseq-generate "$M/bin" --user-dir fairseq_fastgen --path "$BASE" --cpu --gen-subset "${SUBSET:-test}" \
      --batch-size 64 --required-batch-size-multiple 1 --post-process sentencepiece --step-engine static \
      "${options[@]}" "${EXTRA_OPTIONS[@]}" > "$out.partial" 2> "$OUT/$search-$precision.err"
    mv "$out.partial" "$out"
  done
done
.venv/bin/python - "$OUT" <<'EOF'
import sys
from pathlib import Path

import sacrebleu
from sacrebleu.significance import PairedTest


def read(path):
    """id -> {"H": the best hypothesis's pieces, "D": its detokenized text}, and id -> reference (T- line)."""
    hypotheses, references = {}, {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        kind, _, rest = line.partition("-")
        number, _, fields = rest.partition("\t")
        if kind == "T":
            references[int(number)] = fields
        elif kind in ("H", "D"):
            text = fields.split("\t", 1)[1] if "\t" in fields else ""
            entry = hypotheses.setdefault(int(number), {})
            entry.setdefault(kind, text)  # the best hypothesis (first printed) only
    return hypotheses, references


out = Path(sys.argv[1])
# p: sacrebleu's paired bootstrap test (1,000 resamples of the sentences) of the BLEU difference against float32
print("| search | precision | sentences | BLEU | BLEU - float32 | p | float32's tokens |")
print("|---|---|---|---|---|---|---|")
for search in ("greedy", "beam5"):
    float32, references = read(out / f"{search}-float32.out")
    ids = sorted(references)
    float32_texts, reference_texts = [float32[i]["D"] for i in ids], [[references[i] for i in ids]]
    bleu32 = sacrebleu.corpus_bleu(float32_texts, reference_texts).score
    for precision in ("float32", "int8", "int8-f32vocab", "bf16"):
        hypotheses = float32 if precision == "float32" else read(out / f"{search}-{precision}.out")[0]
        assert sorted(hypotheses) == ids, f"{search}-{precision}: not every sentence answered"
        texts = [hypotheses[i]["D"] for i in ids]
        bleu = sacrebleu.corpus_bleu(texts, reference_texts).score
        same = sum(hypotheses[i]["H"] == float32[i]["H"] for i in ids)
        p = ""
        if precision != "float32":
            systems = [("float32", float32_texts), (precision, texts)]
            metric = sacrebleu.BLEU(references=reference_texts)
            _, scores = PairedTest(systems, {"BLEU": metric}, None, test_type="bs", n_samples=1000)()
            p = f"{scores['BLEU'][1].p_value:.3f}"  # (scores["BLEU"][0]: float32's own, without a p)
        print(f"| {search} | {precision} | {len(ids)} | {bleu:.2f} | {bleu - bleu32:+.2f} | {p} | "
              f"{same} ({100 * same / len(ids):.1f}%) |")
EOF
