"""Benchmark of the FastSeq optimizations: whole fairseq-generate runs, stock vs plugin.

    python -m fairseq_fastgen.fastseq.benchmark DATA_BIN CHECKPOINT [--repeats 3] [--subset test] \
        [--threads 1] [--extra FAIRSEQ_GENERATE_OPTIONS...]

Every variant is the real fairseq-generate command (beam 4, batch 64 by default),
run ``--repeats`` times in a fresh process; the table shows the median wall
time, the median CPU time (user + system; steadier than wall time on a shared
machine), the peak resident memory of the process and, from the same models
in-process, the peak bytes of the encoder-decoder attention cache.  Each
variant's printed lines are checked against the first variant that bans
the same n-grams (stock with banning stands apart: it bans nothing).
"""

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List

from fairseq_fastgen import toy

NO_SHARED_CACHE = ["--no-shared-encoder-cache"]
ASYNC = ["--postprocess-workers", "4"]


@dataclass
class Variant:
    name: str
    plugin: bool
    options: List[str]


def variants(ngram_size: int) -> List[Variant]:
    ngram = ["--no-repeat-ngram-size", str(ngram_size)]
    plain = ["--no-repeat-ngram-size", "0"]
    return [
        Variant(f"stock fairseq, n-gram {ngram_size} (bans nothing on CPU)", False, ngram),
        Variant("plugin: n-gram op only", True, ngram + NO_SHARED_CACHE),
        Variant("plugin: n-gram op + shared cache", True, ngram),
        Variant("plugin: n-gram op + async post-processing", True, ngram + NO_SHARED_CACHE + ASYNC),
        Variant("plugin: all (n-gram op, shared cache, async)", True, ngram + ASYNC),
        Variant("stock fairseq, no n-gram banning", False, plain),
        Variant("plugin: shared cache only", True, plain),
        Variant("plugin: async post-processing only", True, plain + NO_SHARED_CACHE + ASYNC),
    ]


@dataclass
class Measurement:
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    printed: List[str]


def run_generate(data_bin, checkpoint, variant: Variant, common: List[str], threads: int) -> Measurement:
    program = toy.fairseq_command("generate") if variant.plugin else toy.stock_fairseq_command("generate")
    command = program + [str(data_bin), "--path", str(checkpoint), "--cpu"] + common
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if variant.plugin:
        command += ["--user-dir", toy.PLUGIN_DIR]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(command + variant.options, stdout=stdout, stderr=stderr, env=env, text=True)
        _, status, usage = os.wait4(process.pid, 0)  # this child's own resource usage
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        if process.returncode != 0:
            raise RuntimeError(f"{variant.name} failed:\n{stderr.read()[-3000:]}")
        printed = [line for line in stdout.read().splitlines() if " | INFO | " not in line and " | WARNING | " not in line]
    return Measurement(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, printed)  # ru_maxrss: KiB


def cache_peak_bytes(data_bin, checkpoint, subset, beam, batch_size, shared, threads):
    """Peak bytes of the encoder-decoder attention caches over one pass of ``subset``."""
    import torch
    from fairseq import checkpoint_utils
    from fairseq.dataclass.configs import GenerationConfig

    import fairseq_fastgen  # noqa: F401
    from fairseq_fastgen.fastseq import encoder_attention_cache_bytes, share_encoder_cache

    torch.set_num_threads(threads)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides={"data": str(data_bin)})
    for model in models:
        model.eval()
    task.load_dataset(subset)
    generator = task.build_generator(models, GenerationConfig(beam=beam, no_shared_encoder_cache=True))
    if shared:
        share_encoder_cache(generator)
    peak = 0
    forward_decoder = generator.model.forward_decoder

    def measuring_forward_decoder(tokens, encoder_outs, incremental_states, temperature=1.0):
        nonlocal peak
        result = forward_decoder(tokens, encoder_outs, incremental_states, temperature)
        peak = max(peak, encoder_attention_cache_bytes(models, incremental_states))
        return result

    generator.model.forward_decoder = measuring_forward_decoder
    batches = task.get_batch_iterator(task.dataset(subset), max_sentences=batch_size,
                                      required_batch_size_multiple=1, disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the data loader's pin_memory note on CPU
        for sample in batches:
            generator.generate(models, sample)
    return peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--ngram", type=int, default=3, help="--no-repeat-ngram-size of the banning variants")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run (OMP_NUM_THREADS)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more fairseq-generate options, for every run")
    args = parser.parse_args(argv)
    common = ["--gen-subset", args.subset, "--beam", str(args.beam), "--batch-size", str(args.batch_size),
              "--required-batch-size-multiple", "1"] + args.extra

    print(f"fairseq-generate on {args.data_bin} ({args.subset}), beam {args.beam}, batch {args.batch_size}, "
          f"{args.threads} thread(s), median of {args.repeats} runs {' '.join(args.extra)}")
    print(f"{'variant':50s} {'wall s':>8s} {'cpu s':>8s} {'peak RSS MB':>12s}  output")
    reference = {}
    for variant in variants(args.ngram):
        runs = [run_generate(args.data_bin, args.checkpoint, variant, common, args.threads) for _ in range(args.repeats)]
        banning = "--no-repeat-ngram-size 0" not in " ".join(variant.options)
        if banning and not variant.plugin:
            same = "its own (stock bans nothing)"
        else:
            expected = reference.setdefault(banning, runs[0].printed)
            same = "identical" if all(r.printed == expected for r in runs) else "DIFFERS"
        print(f"{variant.name:50s} {statistics.median(r.wall_s for r in runs):8.2f} "
              f"{statistics.median(r.cpu_s for r in runs):8.2f} {max(r.peak_rss_mb for r in runs):12.0f}  {same}")
    for shared in (False, True):
        peak = cache_peak_bytes(args.data_bin, args.checkpoint, args.subset, args.beam, args.batch_size, shared,
                                args.threads)
        label = "shared per sentence" if shared else "stock, per beam"
        print(f"encoder-decoder attention cache peak ({label}): {peak / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
