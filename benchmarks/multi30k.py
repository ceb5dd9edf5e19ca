"""Build the Multi30k English->French benchmark models (not part of the product).

Usage (from the repository root, after ``make test`` or ``make demo`` created .venv):

    .venv/bin/python benchmarks/multi30k.py --data ../shared/data/multi30k-en-fr --out bench_out/multi30k
    .venv/bin/python benchmarks/multi30k.py --size base   # transformer_wmt_en_de shapes, 32k BPE: bench_out/multi30k-base

``--size`` picks the model and its vocabulary (``SIZES``): ``toy`` the 3+3-layer, 256-wide model with an 8k
unigram vocabulary; ``base`` the shapes of fairseq's ``transformer_wmt_en_de`` (6+6 layers, 512 wide, FFN 2048,
8 heads) and ``big`` those of ``transformer_vaswani_wmt_en_de_big`` (6+6, 1024, FFN 4096, 16 heads), both with a
32k BPE vocabulary (every piece in the dictionary). Every option below overrides its size's value. Training runs
on CUDA with mixed precision (``--amp``) where a GPU is present, else on the CPU (``--device``).

Steps, each skipped when its output exists (so a rerun resumes):

1. sentencepiece: one joint model (``--spm-vocab``, default 8000; ``--spm-type``, default
   unigram) trained on the training text; every split encoded into pieces;
2. fairseq-preprocess with a joined dictionary (splits: train, valid = val,
   test = test_2016_flickr, test1 = test_2017_flickr); with ``--dict-from-spm`` the
   dictionary holds every sentencepiece piece, used in the training text or not (the
   32k-vocabulary toy model: ``--spm-vocab 32000 --spm-type bpe --dict-from-spm``;
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


def train_step(title, save_dir, checkpoint, train):
    """``step`` for a fairseq-train run into ``save_dir``: done once it returned (``train.done``), not when its first
    checkpoint appears (fairseq writes checkpoints all along, and a stopped run resumes from checkpoint_last.pt).
    A ``checkpoint`` made elsewhere (no ``train.started`` beside it: unpacked from a GPU machine's transport) counts
    as done; fairseq-train's log is written only when it returns, so the marker, not the log, tells a run stopped
    here."""
    save_dir, done, started = Path(save_dir), Path(save_dir) / "train.done", Path(save_dir) / "train.started"
    if Path(checkpoint).exists() and not started.exists() and not (save_dir / "train.log").exists():
        done.touch()

    def train_and_mark():
        save_dir.mkdir(parents=True, exist_ok=True)
        started.touch()
        train()
        done.touch()

    step(title, done, train_and_mark)


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


# each size's model, vocabulary and training (base and big: fairseq's presets' shapes; the learning rate, dropout and
# updates chosen for a 29k-sentence corpus)
SIZES = {
    "toy": dict(layers=3, dim=256, ffn=1024, heads=4, spm_vocab=8000, spm_type="unigram", dict_from_spm=False,
                dropout=0.2, max_update=1200, max_tokens=4096, lr=0.002, warmup=400, validate_interval=3),
    "base": dict(layers=6, dim=512, ffn=2048, heads=8, spm_vocab=32000, spm_type="bpe", dict_from_spm=True,
                 dropout=0.3, max_update=1200, max_tokens=8192, lr=0.0007, warmup=800, validate_interval=5),
    "big": dict(layers=6, dim=1024, ffn=4096, heads=16, spm_vocab=32000, spm_type="bpe", dict_from_spm=True,
                dropout=0.3, max_update=2400, max_tokens=8192, lr=0.0005, warmup=800, validate_interval=10),
}
DEFAULT_OUT = {"toy": "bench_out/multi30k", "base": "bench_out/multi30k-base", "big": "bench_out/multi30k-big"}


def resolve_size(args):
    """Fill every option left unset from ``--size``'s preset (and ``--out``, ``--device``)."""
    for name, value in SIZES[args.size].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if getattr(args, "out", None) is None:
        args.out = DEFAULT_OUT[args.size]
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def base_spec(args, save_every=40):
    return toy.ToyModelSpec(
        layers=args.layers, dim=args.dim, ffn=args.ffn, heads=args.heads, max_positions=256,
        max_update=args.max_update, max_tokens=args.max_tokens, lr=args.lr, warmup=args.warmup,
        validate_interval=args.validate_interval,
        extra_args=["--share-all-embeddings", "--dropout", str(args.dropout), "--weight-decay", "0.0001"]
        + cpu_training(args, save_every),
    )


def cpu_training(args, save_every):
    """Base and big train for hours on a CPU: in bfloat16 mixed precision (``--amp``, which the plugin runs on the
    CPU: 8.5 s an update at base size on 2 Zen 5 cores, 21 s in float32; 16-18 s on a slower machine of that kind)
    where the processor's bfloat16 products beat its float32 ones (the plugin measures them: on an Intel Xeon without
    AMX they do not, and ``--amp`` trains in float32 there, resumable on either kind of machine), and with a
    checkpoint every ``save_every`` updates (the base 40; a student 20, a fine-tuned one's update being the longer),
    so that a stopped run resumes (fairseq-train reads checkpoint_last.pt) within minutes of where it was. The toy
    model keeps its float32 recipe (the demo and the tests train it)."""
    if args.size == "toy" or args.device != "cpu":
        return []
    return ["--amp", "--save-interval-updates", str(save_every), "--keep-interval-updates", "1"]


STUDENT_CRITERION = ["--criterion", "random_subloss", "--label-smoothing", "0.1"]


def console_script(name):
    """A console script of the running interpreter's environment (fastgen-bench, ...)."""
    return str(Path(sys.executable).parent / name)


def add_base_model_options(parser):
    """The base transformer's options (benchmarks/multi30k_distill.py reads the same); unset ones come from --size."""
    parser.add_argument("--size", choices=sorted(SIZES), default="toy",
                        help="the model's shapes, vocabulary and training (SIZES); default: toy")
    parser.add_argument("--layers", type=int, help="encoder and decoder layers of the base model")
    parser.add_argument("--dim", type=int, help="embedding size")
    parser.add_argument("--ffn", type=int, help="feed-forward size")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--dropout", type=float)
    parser.add_argument("--max-update", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--validate-interval", type=int, help="epochs between validations")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="where to train (default: cuda when present)")


def student_spec(args, base_checkpoint, k, lr, updates, freeze_base, extra_args=(), validate_interval=None):
    """A ``transformer_khead`` student (``--khead-identity-first``) warm started from the base model."""
    base = base_spec(args, save_every=20)
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
    parser.add_argument("--out", help="working directory (default: bench_out/multi30k, or -base / -big)")
    parser.add_argument("--spm-vocab", type=int)
    parser.add_argument("--spm-type", choices=["unigram", "bpe"])
    parser.add_argument("--dict-from-spm", action="store_true", default=None,
                        help="fairseq dictionary = every sentencepiece piece (default: the pieces the data uses; "
                             "base and big: every piece)")
    add_base_model_options(parser)
    parser.add_argument("--khead-k", default="2,4", help="comma-separated block sizes of the k-head students")
    parser.add_argument("--khead-updates", type=int, default=400)
    parser.add_argument("--num-clusters", type=int, default=1000)
    parser.add_argument("--stop-after", choices=["text", "bin", "base", "khead", "clusters"], default="clusters")
    args = resolve_size(parser.parse_args(argv))
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
        train_step("train base transformer", out / "base", base, lambda: toy.train(
            bin_dir, out / "base", base_spec(args), show_progress=True, device=args.device))
    if "khead" in wanted:
        for k in (int(k) for k in args.khead_k.split(",")):
            train_step(f"train k-head student k={k} (frozen base)", out / f"khead{k}",
                       out / f"khead{k}" / "checkpoint_last.pt",
                       lambda k=k: toy.train(bin_dir, out / f"khead{k}", khead_spec(args, base, k), show_progress=True,
                                             criterion_args=STUDENT_CRITERION, device=args.device))
    clusters = out / f"clusters{args.num_clusters}.pt"
    if "clusters" in wanted:
        step("cluster file", clusters, lambda: subprocess.run(
            [console_script("fastgen-train-clusters"), str(bin_dir), "--path", str(base),
             "--output", str(clusters), "--num-clusters", str(args.num_clusters), "--cpu"], check=True))
    print("models ready under", out, flush=True)


if __name__ == "__main__":
    main()
