"""Where a decode's time goes on ``--compiled-many-rows kernel`` (not part of the product): the kernel's products
(the encoder's, the decoder steps', the vocabulary projection's) and the log-softmax, timed where they run.

    python benchmarks/decode_time_shares.py DATA_BIN CHECKPOINT [--beam 1] [--batch-size 64] [--max-len-b 25]

Decodes one batch of ``--batch-size`` test sentences from the middle of the length-sorted split (greedy, or stock
beam search with ``--beam`` > 1) on ``--step-engine auto`` (what runs on a processor with AVX2 and no AVX-512), one
thread, once to warm up and once timed, with the kernel's stand-in product and the runner's log-softmax wrapped by
a clock (a few microseconds a call, against ``torch.profiler``'s inflation of every operation). Prints the pass's
seconds and each part's share; "the rest" is attention, norms, cache writes and reorders, the search's bookkeeping.
"""

import argparse
import time
from collections import defaultdict

# first: it loads the plugin, whose options fairseq's GenerationConfig then has
from interleaved import load_test_split  # (benchmarks/, the A/B scripts' own)
import torch  # noqa: E402
from fairseq.dataclass.configs import GenerationConfig  # noqa: E402
from fairseq_fastgen.engine import fairseq_runner  # noqa: E402
from fairseq_fastgen.ops.f32_rows_linear import F32RowsForward  # noqa: E402

seconds = defaultdict(float)  # part -> seconds in the timed pass


def clocked(part_of, function):
    """``function`` adding its seconds to ``seconds[part_of(*args)]``."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        seconds[part_of(*args)] += time.perf_counter() - start
        return result
    return timed


def product_part(forward, x, *_):
    """The part of a decode a product of ``x`` (positions, rows, in) belongs to: a step has one position a row."""
    if forward.linear.weight.size(0) > 8192:
        return "vocabulary projection"
    return "encoder and its keys" if x.size(0) > 1 else "decoder steps' products"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-len-b", type=int, default=25)
    args = parser.parse_args()
    model, task = load_test_split(args.data_bin, args.checkpoint)
    dataset = task.dataset("test")
    by_length = sorted(range(len(dataset)), key=lambda i: dataset.src_sizes[i])
    middle = len(by_length) // 2
    sample = dataset.collater([dataset[i] for i in by_length[middle: middle + args.batch_size]])
    generator = task.build_generator([model], GenerationConfig(
        decoder="greedy" if args.beam == 1 else "beam", beam=args.beam, step_engine="auto", max_len_a=0,
        max_len_b=args.max_len_b))
    F32RowsForward.product = clocked(product_part, F32RowsForward.product)
    fairseq_runner.utils.log_softmax = clocked(lambda *_: "log-softmax", fairseq_runner.utils.log_softmax)
    with torch.inference_mode():
        generator.generate([model], sample)
        seconds.clear()
        start = time.perf_counter()
        generator.generate([model], sample)
        total = time.perf_counter() - start
    seconds["the rest"] = total - sum(seconds.values())
    print(f"{args.batch_size} sentences, beam {args.beam}: {total:.2f} s; "
          + ", ".join(f"{part} {value / total:.0%} ({value:.2f} s)" for part, value in seconds.items()))


if __name__ == "__main__":
    main()
