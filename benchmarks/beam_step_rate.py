"""How close a beam-search step's products run to this core's multiply-add rate (not part of the product).

    python benchmarks/beam_step_rate.py [--rows 320] [--steps 9] [--vocab 32000] [--dim 512] [--ffn 2048] [--layers 6]

Stock beam 5 at batch 64 decodes 320 rows a step. At that many rows a base-size step (6 decoder layers, 512 wide,
FFN 2048, a 32k-token vocabulary) is bound by multiply-adds, not by reading weights: this prints, on one thread,
the median milliseconds and GFLOPS of each shape of the step's products (``int8_step_products.step_shapes``: the
fused query/key/value rows, the attentions' other products, the FFN, the vocabulary) through oneDNN's prepacked
kernel (what the compiled units call for many rows; large buffers from the heap, as in the decoders), their sum for
one step, and the rate of a loop of independent AVX-512 multiply-adds (a C loop built with ``cc -O3
-march=native``: the most this core does with float32 arithmetic).
The step's attention, softmax, cache reorders and the search come on top of these products.
"""

import collections
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from int8_step_products import step_shapes, step_shapes_parser  # (benchmarks/) the same step's shapes
from onednn_products import median_ms  # (benchmarks/)

from fairseq_fastgen.ops.heap import reuse_large_allocations
from fairseq_fastgen.ops.onednn_linear import onednn_linear, pack_weight

FMA_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(void) {
  __m512 acc[12], b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(0.999999f);
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
  struct timespec t0, t1;
  const long n = 200000000;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; i++)
    for (int j = 0; j < 12; j++) acc[j] = _mm512_fmadd_ps(acc[j], b, c);  /* 12 independent chains */
  clock_gettime(CLOCK_MONOTONIC, &t1);
  float sum = 0;
  for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
  double seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  printf("%.1f %g\n", n * 12.0 * 16 * 2 / seconds / 1e9, sum);
  return 0;
}
"""


def fma_gflops():
    """The C loop's GFLOPS, or None where it cannot be built (no compiler, no AVX-512)."""
    with tempfile.TemporaryDirectory() as work:
        source, binary = Path(work) / "fma.c", Path(work) / "fma"
        source.write_text(FMA_LOOP)
        built = subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            print(f"(the multiply-add loop did not build: {built.stderr.strip().splitlines()[-1:]})")
            return None
        return max(float(subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split()[0])
                   for _ in range(3))


def main():
    parser = step_shapes_parser(__doc__.splitlines()[0], 9)  # --steps: timed calls of each shape (after 10 warm-up)
    parser.add_argument("--rows", type=int, default=320, help="rows a step (beam x batch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reuse_large_allocations()  # as the decoders do: a 41 MB output from the heap, not from fresh pages each call
    total_seconds = total_flop = 0.0
    print(f"| product ({args.rows} rows) | ms | GFLOPS | in a step |")
    print("|---|---|---|---|")
    for (out_features, in_features), count in collections.Counter(step_shapes(args)).items():
        packed = pack_weight(torch.randn(out_features, in_features) * 0.05)
        x = torch.randn(args.rows, in_features)
        seconds = median_ms(lambda: onednn_linear(x, packed, None), args.steps) / 1e3
        flop = 2.0 * args.rows * in_features * out_features
        total_seconds += count * seconds
        total_flop += count * flop
        print(f"| {out_features}x{in_features} | {1e3 * seconds:.2f} | {flop / seconds / 1e9:.0f} | x{count} |",
              flush=True)
    rate = total_flop / total_seconds / 1e9
    print(f"\none step's products: {1e3 * total_seconds:.0f} ms, {total_flop / 1e9:.1f} GFLOP, {rate:.0f} GFLOPS")
    peak = fma_gflops()
    if peak is not None:
        print(f"independent AVX-512 multiply-adds: {peak:.0f} GFLOPS; the products run at {rate / peak:.0%} of it")


if __name__ == "__main__":
    main()
