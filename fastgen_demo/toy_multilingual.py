"""A multilingual toy model: two source languages into one target, as fairseq trains them.

Its corpus is :mod:`fastgen_demo.multi_source`'s (the synthetic corpus with
a second source language, line-aligned); one dictionary serves every language;
fairseq-train trains one shared ``transformer`` with the ``translation_multi_simple_epoch``
task.  Used by the cluster projection's tests; :func:`binarize_multilingual` and
:func:`multilingual_task_args` serve benchmarks too.

Kept apart from ``toy.py`` on purpose: the cache keys of the k-head toy models
hash that file, and every change to it retrains them.
"""

from pathlib import Path
from typing import List

from fastgen_demo.multi_source import generate_multi_source_corpus
from fastgen_demo.toy import TGT, ToyModelSpec, fairseq_command, run, train

MULTILINGUAL_SOURCES = ("en", "de")  # into TGT; "de" is the synthetic second source language
MULTILINGUAL_TASK = "translation_multi_simple_epoch"


def multilingual_pairs(sources=MULTILINGUAL_SOURCES, target=TGT) -> List[str]:
    return [f"{source}-{target}" for source in sources]


def multilingual_task_args(lang_pairs) -> List[str]:
    """fairseq's multilingual task as it trains one shared ``transformer``: a source language token
    in the encoder, a target language token forced first in the decoder. Decoding repeats these
    options and adds ``--source-lang`` and ``--target-lang``."""
    return ["--task", MULTILINGUAL_TASK, "--lang-pairs", ",".join(lang_pairs),
            "--encoder-langtok", "src", "--decoder-langtok"]


def make_multilingual_corpus(raw_dir, n_train=4000, n_valid=200, n_test=200, seed=1):
    return generate_multi_source_corpus(raw_dir, n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed,
                                        sources=MULTILINGUAL_SOURCES, tgt=TGT)


def binarize_multilingual(raw_dir, bin_dir, lang_pairs, test_prefixes=("test",), workers=1):
    """One dictionary for every language (``dict.LANG.txt``, all equal, as the multilingual task
    requires), built from every language's ``RAW/train.LANG``; then every pair's splits
    (``RAW/{train,valid,test...}.LANG``) binarized with it."""
    raw_dir, bin_dir = Path(raw_dir), Path(bin_dir)
    languages = sorted({lang for pair in lang_pairs for lang in pair.split("-")})
    joint = raw_dir / "joint-dictionary"
    joint.mkdir(exist_ok=True)
    (joint / "train.all").write_text("".join((raw_dir / f"train.{lang}").read_text(encoding="utf-8")
                                             for lang in languages), encoding="utf-8")
    run(fairseq_command("preprocess") + [
        "--only-source", "--source-lang", "all", "--trainpref", str(joint / "train"), "--dict-only",
        "--destdir", str(joint), "--workers", str(workers),
    ], log_path=Path(bin_dir).parent / "dictionary.log")
    dictionary = joint / "dict.all.txt"
    testpref = ",".join(str(raw_dir / prefix) for prefix in test_prefixes)
    for pair in lang_pairs:
        source, target = pair.split("-")
        run(fairseq_command("preprocess") + [
            "--source-lang", source, "--target-lang", target, "--srcdict", str(dictionary),
            "--tgtdict", str(dictionary), "--trainpref", str(raw_dir / "train"), "--validpref",
            str(raw_dir / "valid"), "--testpref", testpref, "--destdir", str(bin_dir), "--workers", str(workers),
        ], log_path=Path(bin_dir).parent / f"preprocess.{pair}.log")
    return bin_dir


def multilingual_spec(spec: ToyModelSpec, lang_pairs) -> ToyModelSpec:
    """``spec`` trained as a multilingual model of ``lang_pairs`` (one shared transformer)."""
    return ToyModelSpec(**{**spec.__dict__, "extra_args": list(spec.extra_args) + multilingual_task_args(lang_pairs)})


def build_multilingual_toy_model(out_dir, spec: ToyModelSpec, n_train=4000, n_valid=200, n_test=200):
    """Corpus (``raw``: en, de and fr, line-aligned), data-bin (``bin``) and a trained multilingual
    checkpoint (``ckpt``) of en-fr and de-fr under ``out_dir``."""
    out_dir = Path(out_dir)
    pairs = multilingual_pairs()
    make_multilingual_corpus(out_dir / "raw", n_train=n_train, n_valid=n_valid, n_test=n_test)
    (out_dir / "bin").mkdir()
    binarize_multilingual(out_dir / "raw", out_dir / "bin", pairs)
    (out_dir / "ckpt").mkdir(exist_ok=True)
    train(out_dir / "bin", out_dir / "ckpt", multilingual_spec(spec, pairs))
