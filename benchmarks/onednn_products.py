"""torch's default CPU product (MKL) against oneDNN's packed one (``--onednn-linear``) at decoding shapes.

    python benchmarks/onednn_products.py [--repeat 200] [--shapes]

For each weight of the Multi30k transformer (dim 256, ffn 1024, 8k vocabulary)
and each number of rows (one decoder step of greedy decoding at batch 1 is 1
row, a blockwise pass at batch 1 is 4, beam 5 at batch 64 is 320), prints the
median milliseconds of ``F.linear`` and of :func:`onednn_linear` on one thread,
and the largest difference between their outputs.  ``--shapes`` measures instead
what each new row count costs oneDNN (it builds one primitive per shape): the
resident memory added and the first call's extra time, over row counts 1..320.
Not part of the product: a measuring aid for docs/benchmarks.md.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from fairseq_fastgen.bench.memory import rss_mib
from fairseq_fastgen.ops.onednn_linear import onednn_linear, pack_weight

WEIGHTS = {"attention 256x256": (256, 256), "fc1 1024x256": (1024, 256), "fc2 256x1024": (256, 1024),
           "vocabulary 8008x256": (8008, 256)}
ROWS = (1, 2, 4, 8, 16, 64, 320)


def median_ms(call, repeat):
    for _ in range(10):
        call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def new_shapes(max_rows=320):
    weight = torch.randn(8008, 256)
    packed = pack_weight(weight)
    before, first, second = rss_mib(), 0.0, 0.0
    for rows in range(1, max_rows + 1):
        x = torch.randn(rows, 256)
        for call in range(2):
            start = time.perf_counter()
            onednn_linear(x, packed, None)
            elapsed = time.perf_counter() - start
            first, second = (first + elapsed, second) if call == 0 else (first, second + elapsed)
    print(f"{max_rows} row counts on the 8008 x 256 weight: resident memory +{rss_mib() - before:.0f} MiB, "
          f"first calls {1e3 * (first - second) / max_rows:.2f} ms slower than second calls on average")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--shapes", action="store_true", help="the cost of new row counts instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.shapes:
        return new_shapes()
    print("| weight | " + " | ".join(f"{rows} rows" for rows in ROWS) + " |")
    print("|---" * (len(ROWS) + 1) + "|")
    for name, (out_features, in_features) in WEIGHTS.items():
        weight, bias = torch.randn(out_features, in_features) * 0.05, torch.randn(out_features) * 0.01
        packed = pack_weight(weight)
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            mkl = median_ms(lambda: F.linear(x, weight, bias), args.repeat)
            onednn = median_ms(lambda: onednn_linear(x, packed, bias), args.repeat)
            diff = float((F.linear(x, weight, bias) - onednn_linear(x, packed, bias)).abs().max())
            cells.append(f"{mkl:.3f} / {onednn:.3f} ({mkl / onednn:.1f}x, {diff:.0e})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
