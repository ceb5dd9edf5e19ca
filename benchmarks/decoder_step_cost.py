"""Cost of one incremental decoder step (vocabulary projection included) against the rows it computes.

    python benchmarks/decoder_step_cost.py --path CKPT --data DATA_BIN [--rows 4,8,16,32,64,128] [--threads 1]

Feeds random source sentences of 16 tokens and decodes 20 greedy steps for each
row count; prints the best of 3 runs, in ms per step.  It tells whether a
machine's step cost is mostly per call (what streaming and blockwise decoding
save) or mostly per row (what they do not).
"""

import argparse
import time

import torch
from fairseq import checkpoint_utils

import fairseq_fastgen  # noqa: F401  (checkpoint loading with torch >= 2.6)
from fairseq_fastgen.sequence_generators.runner import ModelRunner


def step_ms(runner, rows, src_len=16, steps=20, runs=3):
    vocabulary = runner.model.encoder.embed_tokens.num_embeddings
    src = torch.randint(4, vocabulary, (rows, src_len))
    src[:, -1] = 2  # eos
    best = float("inf")
    with torch.no_grad():
        encoder_out = runner.encode({"src_tokens": src, "src_lengths": torch.full((rows,), src_len)})
        for _ in range(runs):
            cache, tokens = runner.new_cache(), torch.full((rows, 1), 2)
            start = time.perf_counter()
            for _ in range(steps):
                lprobs, _ = runner.step(tokens, encoder_out, cache)
                tokens = torch.cat([tokens, lprobs.argmax(-1, keepdim=True)], dim=1)
            best = min(best, (time.perf_counter() - start) / steps)
    return 1000 * best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", default="4,8,16,32,64,128")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    runner = ModelRunner(models[0].eval())
    for rows in (int(r) for r in args.rows.split(",")):
        print(f"{rows:5d} rows: {step_ms(runner, rows):7.2f} ms/step")


if __name__ == "__main__":
    main()
