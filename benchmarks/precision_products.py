"""``--quantize``'s products at the base model's shapes, one thread, under inference mode.

1. One product, median microseconds of one call for 1, 4, 16, 64 and 320 rows: float32 (``F.linear``), int8 rows
   through the plugin's kernel (``ops/int8_kernel.py``), through fbgemm's and through oneDNN's (all three the same
   bits), and bfloat16 (``--quantize bf16``).  A weight timed alone is read from the processor's cache.
2. The 49 products of one base-size decoder step (6 layers of 6 attention products of 512 x 512, FFN 2048 x 512 and
   512 x 2048, the 32003 x 512 vocabulary projection), each weight of its own, so that they come from memory as in
   decoding: median milliseconds for the step's products, float32 against int8 rows in each kernel.
3. What ``--quantize int8`` adds to loading: the time to round and pack every linear weight of a base model (the
   encoder's 36, the decoder's 60 with the vocabulary projection), as it happens on first use, through each kernel.

    .venv/bin/python benchmarks/precision_products.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fairseq_fastgen.ops import int8_kernel, precision_linear
from fairseq_fastgen.ops.precision_linear import Int8Rows, bf16_linear, int8_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onednn_products import median_ms  # noqa: E402  (the timing of one call, shared with that script)

SHAPES = [(512, 512), (2048, 512), (512, 2048), (32003, 512)]  # (out, in): attention, FFN in / out, vocabulary
STEP_SHAPES = ([(512, 512)] * 6 + [(2048, 512), (512, 2048)]) * 6 + [(32003, 512)]
ROWS = (1, 4, 16, 64, 320)
PASSES = 40  # timed calls of a product, fewer where one call takes long (oneDNN's int8 on AMD: seconds)
BUDGET_S = 0.5
TOO_SLOW_S = 1.0  # a call slower than this is shown as such, not timed


def median_us(call) -> float:
    """median_ms's microseconds, with fewer passes for a slow call and none for a call slower than TOO_SLOW_S."""
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    if seconds > TOO_SLOW_S:
        return float("inf")
    return 1e3 * median_ms(call, max(3, min(PASSES, int(BUDGET_S / seconds))))


def int8_kernels(weight, with_onednn=True):
    """name -> product of int8 rows, each kernel that runs here (oneDNN's only ``with_onednn``)."""
    library = Int8Rows(weight, kernel=False)
    kernels = {}
    if int8_kernel.available():
        own = Int8Rows(weight, kernel=True)
        kernels["int8 rows, plugin's kernel"] = lambda x: int8_linear(x, own, None)
    kernels["int8 rows, fbgemm"] = lambda x: in_library(x, library, 10 ** 9)
    measured = precision_linear.onednn_int8_fast
    precision_linear.onednn_int8_fast = lambda: True  # the option takes oneDNN's only where it is not on a
    try:                                               # reference path: time it here whatever the processor
        if with_onednn and precision_linear.onednn_int8_available():
            in_onednn = Int8Rows(weight, kernel=False)
            kernels["int8 rows, oneDNN"] = lambda x: in_library(x, in_onednn, 1)
    finally:
        precision_linear.onednn_int8_fast = measured
    return kernels


def in_library(x, rows, onednn_min_rows):
    """``--quantize int8``'s product in the library kernels: oneDNN's from ``onednn_min_rows`` rows, fbgemm's below."""
    precision_linear.ONEDNN_MIN_ROWS = onednn_min_rows
    return int8_linear(x, rows, None)


def one_product():
    names = None
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features) / in_features ** 0.5
        weight_bf16 = weight.bfloat16()
        calls = {"float32": lambda x: F.linear(x, weight), **int8_kernels(weight)}
        if precision_linear.precision_refusal("bf16") is None:
            calls["bf16"] = lambda x: bf16_linear(x, weight_bf16, None)
        if names is None:
            names = list(calls)
            print("| weight (out x in) | rows | " + " | ".join(f"{name} us" for name in names) + " |")
            print("|---|---|" + "---|" * len(names))
        for count in ROWS:
            x = torch.randn(count, in_features)
            times = [median_us(lambda: call(x)) for call in calls.values()]
            print(f"| {out_features} x {in_features} | {count} | " + " | ".join(f"{t:,.0f}" if t < float("inf") else f"> {TOO_SLOW_S:g} s" for t in times) + " |")


def random_weights(shapes):
    """A weight of each (out, in) shape, entries of the scale a trained layer's have."""
    return [torch.randn(out_features, in_features) / in_features ** 0.5 for out_features, in_features in shapes]


def decoder_step_products():
    weights = random_weights(STEP_SHAPES)
    steps = {"float32": [lambda x, w=w: F.linear(x, w) for w in weights]}
    for weight in weights:
        for name, call in int8_kernels(weight, with_onednn=False).items():  # oneDNN's: slower than fbgemm's at
            steps.setdefault(name, []).append(call)                         # few rows wherever measured
    print("\n| rows | " + " | ".join(f"{name} ms" for name in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for count in (1, 2, 4, 8, 16, 64):
        inputs = [torch.randn(count, in_features) for _, in_features in STEP_SHAPES]
        times = {name: [] for name in steps}
        for _ in range(6):  # interleaved passes: the first warms up
            for name, products in steps.items():
                start = time.perf_counter()
                for product, x in zip(products, inputs):
                    product(x)
                times[name].append(time.perf_counter() - start)
        print(f"| {count} | " + " | ".join(f"{1e3 * statistics.median(t[1:]):,.2f}" for t in times.values()) + " |")


MODEL_SHAPES = [(512, 512)] * 4 * 6 + [(2048, 512), (512, 2048)] * 6 + STEP_SHAPES + [(512, 512)] * 2 * 6


def quantizing_time():
    """Seconds to make the int8 rows of every linear weight of a base model (MODEL_SHAPES), per kernel."""
    weights = random_weights(MODEL_SHAPES)
    entries = sum(w.numel() for w in weights)
    kernels = {"plugin's kernel": True} if int8_kernel.available() else {}
    kernels["fbgemm / oneDNN"] = False
    for name, kernel in kernels.items():
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            for weight in weights:
                Int8Rows(weight, kernel=kernel)
            seconds.append(time.perf_counter() - start)
        print(f"quantizing a base model's {len(weights)} linear weights ({entries / 1e6:.1f}M entries), "
              f"{name}: {1e3 * statistics.median(seconds):,.0f} ms")


def main():
    torch.set_num_threads(1)
    with torch.inference_mode():
        one_product()
        decoder_step_products()
        quantizing_time()


if __name__ == "__main__":
    main()
