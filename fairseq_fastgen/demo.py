"""``make demo``: the main job on the embedded default.

1. generate the synthetic English-like -> French-like corpus (fairseq_fastgen.data.synthetic),
2. binarize it with fairseq-preprocess,
3. train a tiny base transformer with fairseq-train (its progress bar shows),
4. train a k-head student on top of it (frozen base, the blockwise method's cheapest variant),
5. translate the test split with every registered decoder through ``fastgen-bench``,
   which prints one table: decoder, BLEU, sentences/s and the decoder's statistics.

Everything lands in ``demo_out/`` (or ``--out``); finished steps are reused on a rerun.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from fairseq_fastgen import toy
from fairseq_fastgen.sequence_generators import DECODERS

BASE_SPEC = toy.ToyModelSpec(layers=2, dim=128, ffn=256, heads=4, max_positions=128, max_update=600,
                             max_tokens=4096, lr=0.003, warmup=200, validate_interval=4)
KHEAD_BLOCK_SIZE = 4


def khead_spec(base_checkpoint):
    return toy.ToyModelSpec(
        **{**BASE_SPEC.__dict__, "arch": "transformer_khead", "max_update": 200, "lr": 0.002, "warmup": 50,
           "extra_args": ["--block-size", str(KHEAD_BLOCK_SIZE), "--khead-identity-first", "--freeze-base",
                          "--base-checkpoint", str(base_checkpoint)]}
    )


def step(title, done_marker, action):
    started = time.time()
    if Path(done_marker).exists():
        print(f"== {title}: reusing {done_marker}", flush=True)
        return
    print(f"== {title}", flush=True)
    action()
    print(f"   done in {time.time() - started:.0f}s", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="working directory (default: demo_out)")
    parser.add_argument("--train-sentences", type=int, default=20000)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    step("corpus", out / "raw" / "test.fr",
         lambda: print("  ", toy.make_corpus(out / "raw", n_train=args.train_sentences)["counts"]))
    step("binarize", out / "bin" / "test.en-fr.fr.bin", lambda: toy.binarize(out / "raw", out / "bin"))
    base = out / "base" / "checkpoint_last.pt"
    step("train base transformer", base, lambda: toy.train(out / "bin", out / "base", BASE_SPEC, show_progress=True))
    bench_args = ["--path", str(base)]
    if "blockwise" in DECODERS:
        khead = out / "khead" / "checkpoint_last.pt"
        step(f"train k-head student (k={KHEAD_BLOCK_SIZE}, frozen base)", khead,
             lambda: toy.train(out / "bin", out / "khead", khead_spec(base), show_progress=True,
                               criterion_args=["--criterion", "random_subloss", "--label-smoothing", "0.1"]))
        bench_args += ["--khead-path", str(khead)]

    print("== translate the test split with every decoder", flush=True)
    bench = [sys.executable, "-m", "fairseq_fastgen.bench", str(out / "bin"), *bench_args,
             "--decoders", ",".join(DECODERS), "--beam", "5", "--batch-size", "64", "--repeat", "1",
             "--output-dir", str(out / "bench")]
    subprocess.run(bench, check=True)
    print(f"demo finished in {time.time() - started:.0f}s; outputs in {out}/", flush=True)


if __name__ == "__main__":
    main()
