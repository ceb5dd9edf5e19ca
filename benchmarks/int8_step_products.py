"""What one base-size decoder step's int8 products cost at 1, 2, 4 and 8 rows, on one thread.

    python benchmarks/int8_step_products.py [--vocab 32000] [--dim 512] [--ffn 2048] [--layers 6]

Times the plugin's int8 kernel (``precision_linear.Int8Rows``) over every product of a decoder step of
``transformer_wmt_en_de``'s shapes (per layer: the fused query/key/value rows, the self-attention's output, the
encoder-decoder attention's query and output, the two feed-forward layers; then the vocabulary projection), random
weights, each product after the others so that its rows come from memory as in a decode.  Blockwise verifies a block
of 4 positions in one pass: it pays where 4 rows cost about what 1 costs (the products bound by reading the rows),
and less where the core's arithmetic shows (a shared host's slower sittings).  Not part of the product: a measuring
aid for docs/benchmarks.md.
"""

import argparse
import time

import torch

from fairseq_fastgen.ops.precision_linear import Int8Rows


def step_shapes_parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The options of a decoder step's shapes (``step_shapes``) and of the timed steps."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per row count")
    return parser


def step_shapes(args):
    """(out, in) of each product of a decoder step, in the order a step runs them."""
    dim, ffn = args.dim, args.ffn
    layer = [(3 * dim, dim), (dim, dim), (dim, dim), (dim, dim), (ffn, dim), (dim, ffn)]
    return layer * args.layers + [(args.vocab, dim)]


def main():
    args = step_shapes_parser(__doc__.splitlines()[0], 50).parse_args()
    torch.set_num_threads(1)
    dim, ffn = args.dim, args.ffn
    shapes = step_shapes(args)
    products = [Int8Rows(torch.randn(out, inp)) for out, inp in shapes]
    megabytes = sum(out * inp for out, inp in shapes) / 1e6  # one byte a weight
    print(f"one step's int8 rows: {megabytes:.1f} MB")
    one_row = None
    for rows in (1, 2, 4, 8):
        inputs = {width: torch.randn(rows, width) for width in (dim, ffn)}
        pairs = [(product, inputs[inp]) for product, (_, inp) in zip(products, shapes)]
        for _ in range(5):  # warm-up
            for product, x in pairs:
                product(x)
        start = time.perf_counter()
        for _ in range(args.steps):
            for product, x in pairs:
                product(x)
        milliseconds = (time.perf_counter() - start) / args.steps * 1e3
        one_row = one_row or milliseconds
        print(f"{rows} row{'s' if rows > 1 else ' '}: {milliseconds:.2f} ms a step ({milliseconds / one_row:.2f}x one "
              f"row's, {megabytes / milliseconds:.1f} GB/s)")


if __name__ == "__main__":
    main()
