"""The plugin and CTranslate2, each in a process of its own (not part of the product).

    python benchmarks/peer_alone.py DATA_BIN CHECKPOINT [--threads 1] [--batch-size 64] [--beam 1]
        [--engine-options=--compiled-freezing] [--sentences 1000] [--rounds 3] [--compute-type float32]
        [--max-len-b N]

fastgen-bench measures CTranslate2 in its own process, its passes interleaved with the plugin's. With more than
one thread that slows CTranslate2: once torch has run on several threads, its idle thread pool slows
CTranslate2's, so for ``--threads`` above 1 its rows say little. Here every
round starts one process for the plugin (``--decoder greedy`` at beam 1, stock beam search above, on
``--step-engine compiled`` and ``--engine-options``) and one for CTranslate2 (``--compute-type``, default float32;
the same batches: fairseq's batches of the test split, sorted by source length), one after the other; each decodes the sentences once to warm
up and three times timed and reports its median. Prints each round's sentences/s, the medians over rounds, their
ratio and how many sentences got the same tokens from both. Set ``FASTGEN_COMPILED_DIR`` to keep the compiled
units between processes (the first round's warm-up compiles what is missing). ``--max-len-b N`` caps every output
at N tokens in both (an untrained model's outputs run to the cap: the same work for both). Int8 on two threads:
``--threads 2 --compute-type int8 --engine-options="--step-engine static --quantize int8"``.
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--engine-options", default="",
                        help="more generation options for the plugin's process, after an equals sign "
                             "(--engine-options=--compiled-freezing)")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compute-type", default="float32", help="CTranslate2's compute_type (int8, ...)")
    parser.add_argument("--max-len-b", type=int, help="outputs of at most this many tokens, in both")
    parser.add_argument("--one", choices=["plugin", "ctranslate2"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load_batches(args, with_model: bool):
    """The checkpoint's model (``with_model``; else None) and task, and fairseq's batches of the first
    ``--sentences`` test sentences.  CTranslate2's process builds no torch model and runs no torch product."""
    import fairseq_fastgen  # noqa: F401  (plugin: --decoder, --step-engine)
    from fairseq import checkpoint_utils, tasks

    if with_model:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint],
                                                                         arg_overrides={"data": args.data_bin})
        model = models[0].eval()
    else:
        state = checkpoint_utils.load_checkpoint_to_cpu(args.checkpoint, arg_overrides={"data": args.data_bin})
        task, model = tasks.setup_task(state["cfg"].task), None
    task.load_dataset("test")
    batches = list(task.get_batch_iterator(task.dataset("test"), max_sentences=args.batch_size,
                                           disable_iterator_cache=True).next_epoch_itr(shuffle=False))
    kept, total = [], 0
    for sample in batches:
        if total >= args.sentences:
            break
        kept.append(sample)
        total += sample["id"].numel()
    return model, task, kept


def plugin_decoder(args, model, task):
    """sample -> {sentence id: best tokens} with the plugin's generator."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_fastgen

    decoder = "greedy" if args.beam == 1 else "beam"
    user_dir = str(Path(fairseq_fastgen.__file__).parent)  # whatever the working directory
    argv = [args.data_bin, "--user-dir", user_dir, "--beam", str(args.beam), "--decoder", decoder,
            "--step-engine", "compiled"] + shlex.split(args.engine_options)
    if args.max_len_b is not None:
        argv += ["--max-len-a", "0", "--max-len-b", str(args.max_len_b)]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), argv))
    generator = task.build_generator([model], cfg.generation)

    def decode(sample):
        hypotheses = generator.generate([model], sample)
        return {int(i): h[0]["tokens"].tolist() for i, h in zip(sample["id"], hypotheses)}
    return decode


def ctranslate2_decoder(args, task):
    """sample -> {sentence id: best tokens} with CTranslate2 in ``--compute-type`` (the converted model cached as
    fastgen-bench's) and fastgen-bench's translation of a batch."""
    import ctranslate2

    from fairseq_fastgen.bench.ctranslate2_peer import convert, translate_sample

    translator = ctranslate2.Translator(str(convert(ctranslate2, args.checkpoint, args.data_bin)), device="cpu",
                                        intra_threads=args.threads, compute_type=args.compute_type)
    cap = {} if args.max_len_b is None else {"max_decoding_length": args.max_len_b}
    return lambda sample: translate_sample(translator, sample, task.source_dictionary, task.target_dictionary,
                                           beam_size=args.beam, **cap)


def run_one(args):
    """A child: decode warm once, then three timed passes; print seconds and tokens as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    model, task, batches = load_batches(args, with_model=args.one == "plugin")
    decode = plugin_decoder(args, model, task) if args.one == "plugin" else ctranslate2_decoder(args, task)
    seconds, tokens = [], {}
    with torch.no_grad():
        for timed in (False, True, True, True):
            start = time.perf_counter()
            for sample in batches:
                tokens.update(decode(sample))
            if timed:
                seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds, "sentences": len(tokens), "tokens": tokens}))


def main():
    args = parse_args()
    if args.one:
        return run_one(args)
    rates = {"plugin": [], "ctranslate2": []}
    tokens = {}
    for round_ in range(args.rounds):
        for which in rates:
            child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", which], check=True,
                                   stdout=subprocess.PIPE, text=True)
            result = json.loads(child.stdout.strip().splitlines()[-1])
            rates[which].append(result["sentences"] / statistics.median(result["seconds"]))
            tokens[which] = result["tokens"]
            print(f"round {round_ + 1}, {which}: {rates[which][-1]:.1f} sentences/s", flush=True)
    medians = {which: statistics.median(values) for which, values in rates.items()}
    same = sum(tokens["plugin"][i] == tokens["ctranslate2"].get(i) for i in tokens["plugin"])
    print(f"threads {args.threads}, batch {args.batch_size}, beam {args.beam}, {args.engine_options or 'compiled'}, "
          f"CTranslate2 {args.compute_type}: "
          f"plugin {medians['plugin']:.1f}, CTranslate2 {medians['ctranslate2']:.1f} sentences/s (median of "
          f"{args.rounds} processes each), {medians['plugin'] / medians['ctranslate2']:.2f}x; the same tokens for "
          f"{same} of {len(tokens['plugin'])} sentences")


if __name__ == "__main__":
    main()
