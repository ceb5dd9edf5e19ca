"""Blockwise decoding at batch 1 with and without its one-row path, in one process (not part of the product).

    python benchmarks/blockwise_one_row_ab.py DATA_BIN CHECKPOINT [--sentences 100] [--rounds 6]

Decodes every (1000 / N)-th sentence of the test split one at a time with greedy decoding, blockwise decoding
through ``BlockwisePolicy.advance_one_row`` (the default for a lone row) and blockwise decoding through the
general path (``policy.one_row_path = False``), all three on the same loaded model with oneDNN's products and,
for blockwise, int8 proposals. The three alternate for ``--rounds`` timed rounds after a warm-up round, so a
change in the machine's speed hits all of them alike. Prints the median seconds of each, the ratios, and checks
that the three outputs are the same tokens.
"""

import argparse

# first: it loads the plugin, whose options fairseq's GenerationConfig then has
from interleaved import load_test_split, print_medians, timed_rounds  # (benchmarks/, the A/B scripts' own)
from fairseq.dataclass.configs import GenerationConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model, task = load_test_split(args.data_bin, args.checkpoint)
    batches = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=1, disable_iterator_cache=True)
    samples = list(batches.next_epoch_itr(shuffle=False))  # sorted by length: take every n-th for all lengths
    samples = samples[:: max(1, len(samples) // args.sentences)][: args.sentences]
    generators = {}
    for name, decoder, one_row in [("greedy", "greedy", None), ("one-row path", "blockwise", True),
                                   ("general path", "blockwise", False)]:
        options = {"blockwise_int8_proposals": True} if decoder == "blockwise" else {}
        generator = task.build_generator([model], GenerationConfig(beam=1, decoder=decoder, onednn_linear=True,
                                                                   **options))
        if one_row is not None:
            generator.policy.one_row_path = one_row
        generators[name] = generator

    def decode_with(generator):
        return lambda: [generator.generate([model], sample)[0][0]["tokens"].tolist() for sample in samples]

    seconds, outputs = timed_rounds({name: decode_with(g) for name, g in generators.items()}, args.rounds)
    same = outputs["greedy"] == outputs["one-row path"] == outputs["general path"]
    median = print_medians(seconds, len(samples))
    print(f"blockwise / greedy: one-row path {median['greedy'] / median['one-row path']:.3f}x, general path "
          f"{median['greedy'] / median['general path']:.3f}x; one-row path against general path "
          f"{median['general path'] / median['one-row path']:.3f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
