"""Peak memory of the encoder-decoder attention cache: stock (one copy per beam) against shared (one per sentence).

    python -m fairseq_fastgen.bench.encoder_cache_memory DATA_BIN CHECKPOINT [--subset test] [--beam 4] [--batch-size 64]

Decodes ``--subset`` with stock beam search in this process, once with the
cache copied per beam and once shared by the beams of a sentence, and prints
the largest size the cache reached.  Whole fairseq-generate timings of the
FastSeq optimizations (stock fairseq beside the plugin, each optimization on
alone, then all) come from ``fastgen-bench --whole-process`` with one
``--variant`` per optimization (docs/benchmarks.md, "FastSeq's optimizations for stock beam search").
"""

import argparse
import logging
import sys
import warnings

import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.configs import GenerationConfig

import fairseq_fastgen  # noqa: F401  (registers the plugin's options in GenerationConfig)
from fairseq_fastgen.adapters.ensemble import observing_steps
from fairseq_fastgen.engine.stock_search import CACHE_KEY
from fairseq_fastgen.fastseq import encoder_attention_cache_bytes


def cache_peak_bytes(data_bin, checkpoint, subset, beam, batch_size, shared, threads):
    """Peak bytes of the encoder-decoder attention caches over one pass of ``subset``."""
    torch.set_num_threads(threads)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides={"data": str(data_bin)})
    for model in models:
        model.eval()
    task.load_dataset(subset)
    # fairseq's runner: its cache is fairseq's incremental state, the keys shared by the beams or one copy each
    config = GenerationConfig(beam=beam, step_engine="fairseq", no_shared_encoder_cache=not shared)
    generator = task.build_generator(models, config)
    peak = 0

    def measure(incremental_states):
        nonlocal peak
        caches = [state.get(CACHE_KEY, state) for state in incremental_states]
        peak = max(peak, encoder_attention_cache_bytes(models, caches))

    with torch.no_grad(), warnings.catch_warnings(), observing_steps(generator, measure):
        warnings.simplefilter("ignore", UserWarning)  # the data loader's pin_memory note on CPU
        batches = task.get_batch_iterator(task.dataset(subset), max_sentences=batch_size, required_batch_size_multiple=1,
                                          disable_iterator_cache=True).next_epoch_itr(shuffle=False)
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
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    print(f"encoder-decoder attention cache on {args.data_bin} ({args.subset}), beam {args.beam}, batch {args.batch_size}")
    for shared in (False, True):
        peak = cache_peak_bytes(args.data_bin, args.checkpoint, args.subset, args.beam, args.batch_size, shared,
                                args.threads)
        label = "shared per sentence" if shared else "stock, per beam"
        print(f"encoder-decoder attention cache peak ({label}): {peak / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
