"""Greedy decoding on --step-engine compiled with finished rows leaving by moves (the engine's ``surviving_rows``:
the last rows take the finished rows' places) and in order (every remaining row's cache copied), in one process (not
part of the product).

    python benchmarks/row_moves_ab.py DATA_BIN CHECKPOINT [--batch-size 32] [--random-batches] [--rounds 3]
        [--quantize int8]

Decodes the test split in batches of ``--batch-size`` (fairseq's, of sentences of similar lengths; with
``--random-batches`` sentences in a fixed random order, as a server's arrivals) with one generator, switching its
runner between both ways for ``--rounds`` timed rounds after a warm-up round, so a change in the machine's speed hits
both alike. Prints the medians, their ratio, and whether every sentence got the same tokens both ways.
"""

import argparse
import random

# first: it loads the plugin, whose options fairseq's GenerationConfig then has
from interleaved import load_test_split, own_attribute, print_medians, timed_rounds  # (benchmarks/)
from fairseq.dataclass.configs import GenerationConfig  # noqa: E402
from fairseq_fastgen.engine.fairseq_runner import ModelRunner


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--random-batches", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantize", default=None, choices=["int8", "bf16"])
    args = parser.parse_args()
    model, task = load_test_split(args.data_bin, args.checkpoint)
    dataset = task.dataset("test")
    if args.random_batches:
        order = list(range(len(dataset)))
        random.Random(1).shuffle(order)
        batches = [dataset.collater([dataset[i] for i in order[k: k + args.batch_size]])
                   for k in range(0, len(order), args.batch_size)]
    else:
        batches = list(task.get_batch_iterator(dataset, max_sentences=args.batch_size,
                                               disable_iterator_cache=True).next_epoch_itr(shuffle=False))
    generator = task.build_generator([model], GenerationConfig(beam=1, decoder="greedy", step_engine="compiled",
                                                               quantize=args.quantize))
    runner = generator.runner

    def decode_with(surviving_rows):
        def decode():
            own_attribute(runner, "surviving_rows", surviving_rows)  # None: the engine's own; else this runner only
            return sorted((int(i), h[0]["tokens"].tolist()) for sample in batches
                          for i, h in zip(sample["id"], generator.generate([model], sample)))
        return decode

    seconds, tokens = timed_rounds({"moves": decode_with(None), "in order": decode_with(ModelRunner.surviving_rows)},
                                   args.rounds)
    median = print_medians(seconds, len(dataset))
    same = sum(a == b for a, b in zip(*tokens.values()))
    print(f"batch {args.batch_size}{', random batches' if args.random_batches else ''}: moves "
          f"{median['in order'] / median['moves']:.3f}x in order; the same tokens for {same} of {len(dataset)} "
          f"sentences")


if __name__ == "__main__":
    main()
