"""What one base-size decoder step's float32 products cost at a few rows (or more), on one thread: the plugin's
kernel of a few rows beside ``F.linear`` and oneDNN's packed product.

    python benchmarks/f32_step_products.py [--rows 1,2,4,8] [--vocab 32000] [--dim 512] [--ffn 2048] [--layers 6]

Times ``torch.ops.fastgen.f32_rows_linear`` (``kernels/f32_rows_cpu.cpp``, on ``f32_rows_pack``'s layout of each
weight) and ``F.linear`` over every product of a decoder step of ``transformer_wmt_en_de``'s shapes (per layer: the
fused query/key/value rows, the self-attention's output, the encoder-decoder attention's query and output, the two
feed-forward layers; then the vocabulary projection), random weights, each product after the others so that its
weights come from memory as in a decode.  Blockwise verifies a block of 4 positions in one pass: it pays where 4 rows
cost about what 1 costs.  ``--rows 64,320`` shows what a batch of 64 rows' products cost, and beam 5's (the kernel
serves the frozen units of up to ``f32_rows_weights.MAX_ROWS`` rows and the step of many rows of
``--compiled-many-rows kernel``; oneDNN's packed product is the one of ``--onednn-linear`` and of the units for many
rows).  Each row count is timed in three rounds; the middle one is printed.
Not part of the product: a measuring aid for docs/benchmarks.md.
"""

import time

import torch
import torch.nn.functional as F

from fairseq_fastgen.engine.f32_rows_weights import MAX_ROWS
from fairseq_fastgen.ops.f32_rows_linear import many_rows_kernel_available
from fairseq_fastgen.ops import int8_kernel
from fairseq_fastgen.ops.heap import reuse_large_allocations
from fairseq_fastgen.ops.onednn_linear import onednn_available, onednn_linear, pack_weight
from int8_step_products import step_shapes, step_shapes_parser  # this folder's: the same step's shapes


def step_milliseconds(products, inputs, steps):
    """Milliseconds of one pass over ``products`` (callables of one input), after two warm-up passes."""
    for _ in range(2):
        for product, x in zip(products, inputs):
            product(x)
    start = time.perf_counter()
    for _ in range(steps):
        for product, x in zip(products, inputs):
            product(x)
    return (time.perf_counter() - start) / steps * 1e3


def main():
    parser = step_shapes_parser(__doc__.splitlines()[0], 20)
    parser.add_argument("--rows", default="1,2,4,8", help="row counts to time, comma-separated")
    args = parser.parse_args()
    row_counts = [int(rows) for rows in args.rows.split(",")]
    if not int8_kernel.f32_rows_available():
        parser.error("the float32 kernel of a few rows is not built here (it needs AVX-512 or AVX2)")
    torch.set_num_threads(1)
    reuse_large_allocations()  # large buffers (the vocabulary's logits of many rows) from the heap, as in a decode
    shapes = step_shapes(args)
    weights = [(torch.randn(out, inp) / inp ** 0.5, torch.randn(out)) for out, inp in shapes]
    packed = [(torch.ops.fastgen.f32_rows_pack(weight), bias, weight.size(0)) for weight, bias in weights]
    kernel = [lambda x, p=p, b=b, o=o: torch.ops.fastgen.f32_rows_linear(x, p, b, o) for p, b, o in packed]
    linear = [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in weights]
    candidates = [("kernel", kernel), ("F.linear", linear)]
    if onednn_available():
        onednn = [(pack_weight(weight), bias) for weight, bias in weights]
        candidates.append(("oneDNN", [lambda x, p=p, b=b: onednn_linear(x, p, b) for p, b in onednn]))
    megabytes = sum(out * inp for out, inp in shapes) * 4 / 1e6
    gflop = sum(2 * out * inp for out, inp in shapes) / 1e9  # one row's
    print(f"one step's float32 weights: {megabytes:.0f} MB")
    first = {}  # each product's milliseconds at the first row count
    for rows in row_counts:
        inputs = [torch.randn(rows, inp) for _, inp in shapes]
        for name, products in candidates:
            if name == "kernel" and rows > MAX_ROWS and not many_rows_kernel_available():
                continue  # the AVX-512 build's passes are for a few rows
            milliseconds = sorted(step_milliseconds(products, inputs, args.steps) for _ in range(3))[1]
            first.setdefault(name, milliseconds)
            print(f"{name:8s} {rows} row{'s' if rows > 1 else ' '}: {milliseconds:.2f} ms a step "
                  f"({milliseconds / first[name]:.2f}x the first row count's, {megabytes / milliseconds:.1f} GB/s, "
                  f"{rows * gflop / milliseconds * 1e3:.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
