"""One linear product at the base model's shapes in float32, int8 rows (``--quantize int8``: through fbgemm's
kernel and through oneDNN's, which give the same bits; the option takes fbgemm's below ``ONEDNN_MIN_ROWS`` rows),
fbgemm's own int8 (one range for the whole input: --blockwise-int8-proposals) and bfloat16 (``--quantize bf16``):
median microseconds of one call on one thread, under inference mode, for 1, 4, 16, 64 and 320 rows. A weight
timed alone is read from the processor's cache; in a decoder step it comes from memory.

    .venv/bin/python benchmarks/precision_products.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fairseq_fastgen.ops import precision_linear
from fairseq_fastgen.ops.precision_linear import Int8Rows, bf16_linear, int8_linear
from fairseq_fastgen.engine.int8_proposals import Int8Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onednn_products import median_ms  # noqa: E402  (the timing of one call, shared with that script)

SHAPES = [(512, 512), (2048, 512), (512, 2048), (32003, 512)]  # (out, in): attention, FFN in / out, vocabulary
ROWS = (1, 4, 16, 64, 320)
PASSES = 40


def main():
    torch.set_num_threads(1)
    print("| weight (out x in) | rows | float32 us | int8 rows, fbgemm us | int8 rows, oneDNN us | fbgemm int8 us "
          "| bf16 us |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features) / in_features ** 0.5
            rows, per_call, weight_bf16 = Int8Rows(weight), Int8Linear(weight), weight.bfloat16()
            for count in ROWS:
                x = torch.randn(count, in_features)
                calls = [lambda: F.linear(x, weight), lambda: int8_rows(x, rows, 10 ** 9),
                         lambda: int8_rows(x, rows, 1), lambda: per_call(x), lambda: bf16_linear(x, weight_bf16, None)]
                times = [1e3 * median_ms(call, PASSES) for call in calls]
                print(f"| {out_features} x {in_features} | {count} | " + " | ".join(f"{t:,.0f}" for t in times) + " |")


def int8_rows(x, rows, onednn_min_rows):
    """``--quantize int8``'s product with oneDNN's kernel from ``onednn_min_rows`` rows, fbgemm's below."""
    precision_linear.ONEDNN_MIN_ROWS = onednn_min_rows
    return int8_linear(x, rows, None)


if __name__ == "__main__":
    main()
