#!/usr/bin/env bash
# The quality of --quantize over whole test splits (test_2016_flickr and test_2017_flickr: 1,000 sentences each):
# BLEU (sacrebleu on the detokenized D- lines against the T- references) and the share of sentences given float32's
# tokens, for greedy and stock beam 5 at batch 64, each precision (int8 also with its vocabulary projection in
# float32) in one fairseq-generate process on --step-engine static (the arithmetic the other engines are held to),
# and CTranslate2's int8 against its own float32 on the same sources where it is installed. Only quality: one pass
# each, no timing (fastgen-bench's rows, benchmarks/precision.sh, measure speed). An output already complete is
# kept (rerun: delete it).
#
#   bash benchmarks/precision_quality.sh [MODEL_DIR] [OUT_DIR] [THREADS]
#
# MODEL_DIR is what `benchmarks/multi30k.py --size base` builds (default bench_out/multi30k-base; out
# bench/precision-quality; 2 threads). BASE overrides the checkpoint (default MODEL_DIR/base/checkpoint_best.pt),
# SUBSETS the splits (default "test test1": their sources are MODEL_DIR/raw/SPLIT.en), EXTRA adds options to every
# fairseq process. Prints one table: each split's BLEU and difference from float32, then both splits pooled with
# the 95% interval of the difference over resamples of the sentences and
# sacrebleu's paired bootstrap p.
set -euo pipefail
M=${1:-bench_out/multi30k-base}
OUT=${2:-bench/precision-quality}
export OMP_NUM_THREADS=${3:-2}
BASE=${BASE:-$M/base/checkpoint_best.pt}
read -r -a EXTRA_OPTIONS <<< "${EXTRA:-}"
read -r -a SPLITS <<< "${SUBSETS:-test test1}"
declare -A SEARCH=([greedy]="--decoder greedy --beam 1" [beam5]="--beam 5")
declare -A PRECISION=([float32]="" [int8]="--quantize int8" [int8-f32vocab]="--quantize int8 --float32-vocabulary-projection"
                      [bf16]="--quantize bf16")
for split in "${SPLITS[@]}"; do
  mkdir -p "$OUT/$split"
  for search in greedy beam5; do
    for precision in float32 int8 int8-f32vocab bf16; do
      out=$OUT/$split/$search-$precision.out
      grep -q "^Generate " "$out" 2> /dev/null && continue
      read -r -a options <<< "${SEARCH[$search]} ${PRECISION[$precision]}"
      echo "== $split $search $precision"
      .venv/bin/fairseq-generate "$M/bin" --user-dir fairseq_fastgen --path "$BASE" --cpu --gen-subset "$split" \
        --batch-size 64 --required-batch-size-multiple 1 --post-process sentencepiece --step-engine static \
        "${options[@]}" "${EXTRA_OPTIONS[@]}" > "$out.partial" 2> "$OUT/$split/$search-$precision.err"
      mv "$out.partial" "$out"
    done
  done
done
.venv/bin/python - "$OUT" "$M" "$BASE" "${SPLITS[@]}" <<'EOF'
import functools
import sys
from pathlib import Path

import numpy
import sacrebleu
from sacrebleu.significance import PairedTest
from fairseq.data.data_utils import post_process

from fairseq_fastgen.ctranslate2_model import convert, import_ctranslate2

out, model_dir, checkpoint, splits = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
BEAMS = {"greedy": 1, "beam5": 5}


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


@functools.lru_cache(maxsize=None)
def ctranslate2_translator(compute_type):
    """CTranslate2's translator of the checkpoint (converted once, kept in $FASTGEN_CACHE); None where not installed."""
    ctranslate2, _ = import_ctranslate2()
    if ctranslate2 is None:
        return None
    return ctranslate2.Translator(str(convert(ctranslate2, checkpoint, str(model_dir / "bin"))), device="cpu",
                                  compute_type=compute_type, intra_threads=2)


def ctranslate2_texts(split, search, compute_type):
    """CTranslate2's detokenized best translations of the split's sources (kept in OUT/SPLIT/SEARCH-ct2-TYPE.txt),
    fairseq-generate's length limit (200 tokens: --max-len-a 0 --max-len-b 200); None where not installed."""
    kept = out / split / f"{search}-ct2-{compute_type}.txt"
    if not kept.exists():
        translator = ctranslate2_translator(compute_type)
        if translator is None:
            return None
        sources = [line.split() for line in (model_dir / "raw" / f"{split}.en").read_text().splitlines()]
        results = translator.translate_batch(sources, max_batch_size=64, beam_size=BEAMS[search],
                                             max_decoding_length=200)
        texts = (post_process(" ".join(r.hypotheses[0]), "sentencepiece") for r in results)  # as --post-process
        kept.write_text("".join(text + "\n" for text in texts), encoding="utf-8")
    return kept.read_text(encoding="utf-8").splitlines()


def difference_interval(texts, base_texts, references, resamples=1000):
    """The 95% interval of BLEU(texts) - BLEU(base_texts) over resamples of the sentences (the same resamples for
    both, as sacrebleu's paired bootstrap draws them, from its sentences' statistics)."""
    metric = sacrebleu.BLEU()
    stats = [numpy.array(metric._extract_corpus_statistics(t, [references])) for t in (texts, base_texts)]
    draws = numpy.random.default_rng(12345).integers(0, len(references), size=(resamples, len(references)))
    differences = [metric._compute_score_from_stats(stats[0][d].sum(0).tolist()).score
                   - metric._compute_score_from_stats(stats[1][d].sum(0).tolist()).score for d in draws]
    low, high = numpy.percentile(differences, [2.5, 97.5])
    return f"{low:+.2f} .. {high:+.2f}"


def systems(search):
    """{name: (texts, tokens or None)} over the splits in turn, the references, {name: its baseline} and the
    sentences of each split."""
    found, references, baselines, sizes = {}, [], {}, []
    for split in splits:
        float32, refs = read(out / split / f"{search}-float32.out")
        ids = sorted(refs)
        references += [refs[i] for i in ids]
        sizes.append(len(ids))
        for precision in ("float32", "int8", "int8-f32vocab", "bf16"):
            hypotheses = float32 if precision == "float32" else read(out / split / f"{search}-{precision}.out")[0]
            assert sorted(hypotheses) == ids, f"{split} {search}-{precision}: not every sentence answered"
            texts, tokens = found.setdefault(precision, ([], []))
            texts += [hypotheses[i]["D"] for i in ids]
            tokens += [hypotheses[i]["H"] for i in ids]
            baselines[precision] = "float32"
        for compute_type in ("float32", "int8"):
            texts = ctranslate2_texts(split, search, compute_type)
            if texts is not None:
                found.setdefault(f"CTranslate2 {compute_type}", ([], None))[0].extend(texts)
                # its float32 beside ours (the same tokens but for a few ties), its int8 beside its float32
                baselines[f"CTranslate2 {compute_type}"] = ("float32" if compute_type == "float32"
                                                            else "CTranslate2 float32")
    complete = {name: value for name, value in found.items() if len(value[0]) == len(references)}
    return complete, references, baselines, sizes


print("| search | precision | " + " | ".join(f"{split} BLEU" for split in splits)
      + " | pooled BLEU | pooled - its float32 | 95% interval | p | its float32's outputs |")
print("|---" * (len(splits) + 7) + "|")
for search in BEAMS:
    found, references, baselines, sizes = systems(search)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # split i: sentences bounds[i] .. bounds[i + 1]
    for name, (texts, tokens) in found.items():
        base_texts, base_tokens = found[baselines[name]]
        cells = []
        for start, end in zip(bounds, bounds[1:]):
            bleu = sacrebleu.corpus_bleu(texts[start:end], [references[start:end]]).score
            base = sacrebleu.corpus_bleu(base_texts[start:end], [references[start:end]]).score
            cells.append(f"{bleu:.2f} ({bleu - base:+.2f})")
        bleu = sacrebleu.corpus_bleu(texts, [references]).score
        base = sacrebleu.corpus_bleu(base_texts, [references]).score
        p = interval = ""
        if texts != base_texts:  # sacrebleu's paired bootstrap (1,000 resamples of the sentences)
            metric = sacrebleu.BLEU(references=[references])
            _, scores = PairedTest([("baseline", base_texts), (name, texts)], {"BLEU": metric}, None,
                                   test_type="bs", n_samples=1000)()
            p = f"{scores['BLEU'][1].p_value:.3f}"  # (scores["BLEU"][0]: the baseline's own, without a p)
            interval = difference_interval(texts, base_texts, references)
        if tokens is not None and base_tokens is not None:
            same = sum(a == b for a, b in zip(tokens, base_tokens))
        else:  # CTranslate2: its detokenized texts
            same = sum(a == b for a, b in zip(texts, base_texts))
        print(f"| {search} | {name} | " + " | ".join(cells)
              + f" | {bleu:.2f} | {bleu - base:+.2f} | {interval} | {p} | "
              f"{same} ({100 * same / len(texts):.1f}%) |")
EOF
