"""Build the Multi30k English->French benchmark models (not part of the product).

Usage (from the repository root, after ``make test`` or ``make demo`` created .venv):

    .venv/bin/python benchmarks/multi30k.py --data ../shared/data/multi30k-en-fr --out bench_out/multi30k

Steps, each skipped when its output exists (so a rerun resumes):

1. sentencepiece: one joint model (``--spm-vocab``, default 8000; ``--spm-type``, default
   unigram) trained on the training text; every split encoded into pieces;
2. fairseq-preprocess with a joined dictionary (splits: train, valid = val,
   test = test_2016_flickr, test1 = test_2017_flickr); with ``--dict-from-spm`` the
   dictionary holds every sentencepiece piece, used in the training text or not (the
   32k-vocabulary model of issue 6: ``--spm-vocab 32000 --spm-type bpe --dict-from-spm``;
   a unigram model of this corpus cannot reach 32k pieces, BPE can);
3. a base ``transformer`` (``--layers`` + ``--layers``, ``--dim``), trained with fairseq-train;
4. k-head students on top of it for each ``--khead-k`` (``transformer_khead``,
   ``--khead-identity-first --freeze-base``, criterion ``random_subloss``);
5. a cluster file for the base model (``fastgen-train-clusters``, teacher-forced on train).

It then prints the ``fastgen-bench`` commands whose tables docs/benchmarks.md holds.
The corpus itself is read from ``--data`` and never copied into the repository.
"""

import argparse
import gzip
import subprocess
import sys
import time
from pathlib import Path

import sentencepiece

from fastgen_demo import toy

SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr", "test1": "test_2017_flickr"}


def step(title, marker, action):
    if Path(marker).exists():
        print(f"== {title}: reusing {marker}", flush=True)
        return
    started = time.time()
    print(f"== {title}", flush=True)
    action()
    print(f"   done in {time.time() - started:.0f}s", flush=True)


def read_lines(path):
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def prepare_text(data, raw, vocab_size, model_type="unigram"):
    raw.mkdir(parents=True, exist_ok=True)
    text = {(split, lang): read_lines(data / f"{name}.{lang}.gz") for split, name in SPLITS.items() for lang in ("en", "fr")}
    joint = raw / "spm_train.txt"
    joint.write_text("\n".join(text[("train", "en")] + text[("train", "fr")]) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(joint), model_prefix=str(raw / "spm"), vocab_size=vocab_size, model_type=model_type,
        character_coverage=1.0, num_threads=2, bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(raw / "spm.model"))
    for (split, lang), lines in text.items():
        pieces = [" ".join(processor.encode(line, out_type=str)) for line in lines]
        (raw / f"{split}.{lang}").write_text("\n".join(pieces) + "\n", encoding="utf-8")


def spm_dictionary(raw):
    """A fairseq dictionary file listing every sentencepiece piece but <unk> (fairseq adds its own)."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(raw / "spm.model"))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size()) if not processor.is_unknown(i)]
    path = raw / "dict.spm.txt"
    path.write_text("".join(f"{piece} 1\n" for piece in pieces), encoding="utf-8")
    return path


def binarize(raw, bin_dir, dict_from_spm=False):
    dictionary = ["--srcdict", str(spm_dictionary(raw))] if dict_from_spm else []
    toy.run(toy.fairseq_command("preprocess") + dictionary + [
        "--source-lang", "en", "--target-lang", "fr", "--joined-dictionary",
        "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test,{raw}/test1",
        "--destdir", str(bin_dir), "--workers", "2",
    ], log_path=bin_dir.parent / "preprocess.log")


def base_spec(args):
    return toy.ToyModelSpec(
        layers=args.layers, dim=args.dim, ffn=4 * args.dim, heads=4, max_positions=256, max_update=args.max_update,
        max_tokens=args.max_tokens, lr=args.lr, warmup=args.warmup, validate_interval=args.validate_interval,
        extra_args=["--share-all-embeddings", "--dropout", "0.2", "--weight-decay", "0.0001"],
    )


STUDENT_CRITERION = ["--criterion", "random_subloss", "--label-smoothing", "0.1"]


def console_script(name):
    """A console script of the running interpreter's environment (fastgen-bench, ...)."""
    return str(Path(sys.executable).parent / name)


def add_base_model_options(parser):
    """The base transformer's options (benchmarks/multi30k_distill.py reads the same)."""
    parser.add_argument("--layers", type=int, default=3, help="encoder and decoder layers of the base model")
    parser.add_argument("--dim", type=int, default=256, help="embedding size (ffn: 4x)")
    parser.add_argument("--max-update", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--validate-interval", type=int, default=3, help="epochs between validations")


def student_spec(args, base_checkpoint, k, lr, updates, freeze_base, extra_args=(), validate_interval=None):
    """A ``transformer_khead`` student (``--khead-identity-first``) warm started from the base model."""
    base = base_spec(args)
    khead_args = ["--block-size", str(k), "--khead-identity-first", "--base-checkpoint", str(base_checkpoint)]
    if freeze_base:
        khead_args.append("--freeze-base")
    return toy.ToyModelSpec(**{
        **base.__dict__, "arch": "transformer_khead", "max_update": updates, "lr": lr, "warmup": 100,
        "validate_interval": validate_interval or base.validate_interval,
        "extra_args": base.extra_args + khead_args + list(extra_args),
    })


def khead_spec(args, base_checkpoint, k):
    return student_spec(args, base_checkpoint, k, args.lr, args.khead_updates, freeze_base=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/multi30k-en-fr", help="directory of the gzipped Multi30k text")
    parser.add_argument("--out", default="bench_out/multi30k", help="working directory")
    parser.add_argument("--spm-vocab", type=int, default=8000)
    parser.add_argument("--spm-type", choices=["unigram", "bpe"], default="unigram")
    parser.add_argument("--dict-from-spm", action="store_true",
                        help="fairseq dictionary = every sentencepiece piece (default: the pieces the data uses)")
    add_base_model_options(parser)
    parser.add_argument("--khead-k", default="2,4", help="comma-separated block sizes of the k-head students")
    parser.add_argument("--khead-updates", type=int, default=400)
    parser.add_argument("--num-clusters", type=int, default=1000)
    parser.add_argument("--stop-after", choices=["text", "bin", "base", "khead", "clusters"], default="clusters")
    args = parser.parse_args(argv)
    data, out = Path(args.data), Path(args.out)
    raw, bin_dir = out / "raw", out / "bin"

    steps = ["text", "bin", "base", "khead", "clusters"]
    wanted = steps[: steps.index(args.stop_after) + 1]
    step("sentencepiece", raw / "test1.fr", lambda: prepare_text(data, raw, args.spm_vocab, args.spm_type))
    if "bin" in wanted:
        bin_dir.mkdir(parents=True, exist_ok=True)
        step("fairseq-preprocess", bin_dir / "test1.en-fr.fr.bin", lambda: binarize(raw, bin_dir, args.dict_from_spm))
    base = out / "base" / "checkpoint_best.pt"
    if "base" in wanted:
        step("train base transformer", base, lambda: toy.train(bin_dir, out / "base", base_spec(args), show_progress=True))
    if "khead" in wanted:
        for k in (int(k) for k in args.khead_k.split(",")):
            step(f"train k-head student k={k} (frozen base)", out / f"khead{k}" / "checkpoint_last.pt",
                 lambda k=k: toy.train(bin_dir, out / f"khead{k}", khead_spec(args, base, k), show_progress=True,
                                       criterion_args=STUDENT_CRITERION))
    clusters = out / f"clusters{args.num_clusters}.pt"
    if "clusters" in wanted:
        step("cluster file", clusters, lambda: subprocess.run(
            [console_script("fastgen-train-clusters"), str(bin_dir), "--path", str(base),
             "--output", str(clusters), "--num-clusters", str(args.num_clusters), "--cpu"], check=True))
    print("models ready under", out, flush=True)


if __name__ == "__main__":
    main()
