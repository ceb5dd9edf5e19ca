"""What writing a step's logits in aligned rows saves: torch's float32 vocabulary projection (and the log-softmax
after it) into a contiguous (rows, vocabulary) result beside the same product into rows padded to 64 bytes
(``fairseq_fastgen/ops/aligned_rows.py``, what the runners' projection does), on one thread.

    python benchmarks/aligned_logits.py [--vocab 32003,32000] [--dim 512] [--rows 1,8,64,320]

Prints milliseconds (median of ROUNDS timed calls) and GFLOP/s of the product, and whether the two give the same bits, for
each vocabulary size and row count.  The weight is a parameter, as a model's (torch multiplies the step's rows as one
matrix), and buffers come from the heap as in a decode (``ops/heap.py``).  Not part of the product: a measuring aid
for docs/benchmarks.md.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_fastgen.ops.aligned_rows import aligned_rows_linear
from fairseq_fastgen.ops.heap import reuse_large_allocations
from onednn_products import median_ms  # this folder's: the median of timed calls after warm-up ones

ROUNDS = 9  # timed calls of each product


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="32003,32000", help="vocabulary sizes, comma-separated")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rows", default="1,8,64,320", help="row counts, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reuse_large_allocations()
    print("vocab  rows  F.linear ms (GFLOP/s)  aligned ms (GFLOP/s)  +log-softmax: F.linear  aligned  speed-up  bits")
    for vocab in (int(v) for v in args.vocab.split(",")):
        weight = nn.Parameter(torch.randn(vocab, args.dim) / args.dim ** 0.5)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(1, rows, args.dim).transpose(0, 1)  # (rows, 1, dim), as a step's features
            with torch.inference_mode():
                plain = median_ms(lambda: F.linear(x, weight), ROUNDS)
                aligned = median_ms(lambda: aligned_rows_linear(x, weight), ROUNDS)
                plain_lp = median_ms(lambda: F.log_softmax(F.linear(x, weight), dim=-1), ROUNDS)
                aligned_lp = median_ms(lambda: F.log_softmax(aligned_rows_linear(x, weight), dim=-1), ROUNDS)
                same = torch.equal(F.linear(x, weight), aligned_rows_linear(x, weight))
            gflop = 2 * rows * vocab * args.dim / 1e9
            print(f"{vocab:5d}  {rows:4d}  {plain:8.2f} ({gflop / plain * 1e3:4.0f})  {aligned:13.2f} ({gflop / aligned * 1e3:4.0f})"
                  f"  {plain_lp:25.2f}  {aligned_lp:7.2f}  {plain_lp / aligned_lp:7.2f}x  {'same' if same else 'DIFFER'}",
                  flush=True)


if __name__ == "__main__":
    main()
