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
import statistics
import time

import torch

import fairseq_fastgen  # noqa: F401  (plugin: --decoder, models)
from fairseq import checkpoint_utils
from fairseq.dataclass.configs import GenerationConfig


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint],
                                                                    arg_overrides={"data": args.data_bin})
    model = models[0].eval()
    task.load_dataset("test")
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
    seconds = {name: [] for name in generators}
    outputs = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, generator in generators.items():
            start = time.perf_counter()
            outputs[name] = [generator.generate([model], sample)[0][0]["tokens"].tolist() for sample in samples]
            if round_:
                seconds[name].append(time.perf_counter() - start)
    same = outputs["greedy"] == outputs["one-row path"] == outputs["general path"]
    median = {name: statistics.median(values) for name, values in seconds.items()}
    for name, values in seconds.items():
        print(f"{name:13s} median {median[name]:.3f} s ({len(samples) / median[name]:.1f} sentences/s); rounds: "
              + ", ".join(f"{value:.3f}" for value in values))
    print(f"blockwise / greedy: one-row path {median['greedy'] / median['one-row path']:.3f}x, general path "
          f"{median['greedy'] / median['general path']:.3f}x; one-row path against general path "
          f"{median['general path'] / median['one-row path']:.3f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
