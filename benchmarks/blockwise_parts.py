"""Where the time of blockwise (and greedy) decoding goes: wall time per part, without a profiler.

    python benchmarks/blockwise_parts.py FASTGEN_BENCH_ARGS...

Runs ``fastgen-bench`` with the given arguments after wrapping the parts of the
blockwise and greedy policies below in wall-clock timers (``time.perf_counter``
around each call; a profiler's own cost would swamp the small operations that
make up a batch-1 step).  Prints the bench's table, then each part's calls,
total seconds and milliseconds per call, over the warm-up and the timed passes.
Times are inclusive: ``advance`` contains ``run_block``, ``log_probs`` and the rest.
Not part of the product: a measuring aid for docs/benchmarks.md.
"""

import collections
import functools
import sys
import time

from fairseq_fastgen.bench import main as bench_main
from fairseq_fastgen.models.transformer_khead import KHeadTransformerDecoder
from fairseq_fastgen.sequence_generators.blockwise.policy import BlockwisePolicy
from fairseq_fastgen.sequence_generators.greedy import GreedyPolicy
from fairseq_fastgen.sequence_generators.blockwise.one_row import OneRowPath
from fairseq_fastgen.sequence_generators.generator import DecodeContext
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from fairseq_fastgen.sequence_generators.state import DecodingState

PARTS = [
    (GreedyPolicy, "advance"), (ModelRunner, "step"),
    (BlockwisePolicy, "start"), (BlockwisePolicy, "advance"), (OneRowPath, "advance_one_row"),
    (BlockwisePolicy, "score_block"), (BlockwisePolicy, "run_block"),
    (BlockwisePolicy, "log_probs"), (BlockwisePolicy, "later_scores"), (BlockwisePolicy, "propose"),
    (BlockwisePolicy, "accepted_prefix"), (DecodeContext, "process"), (DecodingState, "append"),
    (DecodingState, "select"), (KHeadTransformerDecoder, "rollback"),
    # the compiled engine: the encoder, the encoder-decoder keys of a sentence, a unit's call and what is around it
    (CompiledRunner, "encode"), (CompiledRunner, "start_cache"), (CompiledRunner, "step"),
    (CompiledRunner, "block_pass"), (CompiledRunner, "run_padded"),
]

seconds = collections.defaultdict(float)
calls = collections.Counter()


def timed(owner, name):
    label = f"{owner.__name__}.{name}"
    declared = owner.__dict__[name]
    function = declared.__func__ if isinstance(declared, staticmethod) else declared

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, staticmethod(wrapper) if isinstance(declared, staticmethod) else wrapper)


def main():
    for owner, name in PARTS:
        timed(owner, name)
    bench_main(sys.argv[1:])
    print(f"\n{'part':36s} {'calls':>8s} {'seconds':>8s} {'ms/call':>8s}")
    for label, total in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"{label:36s} {calls[label]:8d} {total:8.2f} {1e3 * total / calls[label]:8.3f}")


if __name__ == "__main__":
    main()
