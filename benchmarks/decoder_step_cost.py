"""Cost of one incremental decoder step (vocabulary projection included) per engine and row count.

    python benchmarks/decoder_step_cost.py --path CKPT --data DATA_BIN \
        [--rows 1,4,8,16,32,64,128,320] [--engines fairseq,static,compiled[,compiled-frozen,compiled-eager,compiled-exact]] \
        [--threads 1] [--rounds 5] [--onednn-linear] [--compiled-max-rows N] [--device cuda] [--flop-rate]

Feeds random source sentences of 16 tokens and decodes 20 greedy steps per row
count and ``--step-engine`` setting, the engines interleaved round by round;
prints the median over the rounds in ms per step and each engine's ratio to
fairseq's.  It tells which engine wins at which row count (the compiled step's
first call per shape, its compilation, runs before the timed rounds), and
whether a machine's step cost is mostly per call (what streaming and blockwise
decoding save) or per row.  ``--flop-rate`` adds each engine's rate in GFLOP/s (the step's products, the
vocabulary projection included, over its time) beside the rate of one plain float32 product of the same rows
(rows x dim by dim x vocabulary): how near a step is to what this core's products can do.
"""

import argparse
import contextlib
import statistics
import time

import torch
from fairseq import checkpoint_utils

import fairseq_fastgen  # noqa: F401  (checkpoint loading with torch >= 2.6)
from fairseq_fastgen.adapters.linear_forwards import OneDNNLinears
from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine import build_runner, compiled
from fairseq_fastgen.ops.heap import reuse_large_allocations


def run_steps(runner, encoder_out, rows, steps, capacity):
    device = encoder_out["encoder_out"][0].device
    cache, tokens = runner.new_cache(capacity), torch.full((rows, 1), 2, device=device)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        lprobs, _ = runner.step(tokens, encoder_out, cache)
        tokens = torch.cat([tokens, lprobs.argmax(-1, keepdim=True)], dim=1)
    synchronize(device)
    return (time.perf_counter() - start) / steps, tokens


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_flops(model, rows: int) -> float:
    """Floating-point operations of the products of one step of ``rows`` rows (2 per multiply-add): every
    layer's self-attention (q, k, v, out), encoder-decoder attention (q, out) and feed-forward, and the
    vocabulary projection; the attention scores themselves (a few positions here) are left out."""
    decoder = model.decoder
    layer_weights = sum(p.numel() for layer in decoder.layers for name, p in layer.named_parameters()
                    if name.endswith("weight") and p.dim() == 2 and "encoder_attn.k_proj" not in name
                    and "encoder_attn.v_proj" not in name)
    projection = decoder.output_projection.weight.numel() if decoder.output_projection is not None else 0
    return 2.0 * rows * (layer_weights + projection)


def plain_product_rate(rows: int, dim: int, vocabulary: int, device, rounds: int) -> float:
    """GFLOP/s of torch's float32 product of (rows, dim) by (dim, vocabulary), the median of ``rounds``."""
    left, right = torch.randn(rows, dim, device=device), torch.randn(dim, vocabulary, device=device)
    times = []
    for _ in range(rounds + 1):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            torch.mm(left, right)
        synchronize(device)
        times.append((time.perf_counter() - start) / 10)
    return 2.0 * rows * dim * vocabulary / statistics.median(times[1:]) / 1e9


def make_runner(engine, model):
    """The runner of a --step-engine setting; ``compiled-frozen``: the compiled engine with
    --compiled-freezing; ``compiled-eager``: the compiled engine without its step for many rows (eager above
    the row buckets, its fast form with oneDNN's products: what that step gains); ``compiled-exact``: the same
    with the static engine's exact form instead of the fast form (what the fast form gains)."""
    if engine == "compiled-frozen":
        return build_runner(model, PluginOptions(step_engine="compiled", compiled_freezing=True), 1.0, None)
    if engine not in ("compiled-eager", "compiled-exact"):
        return build_runner(model, PluginOptions(step_engine=engine), 1.0, None)
    runner = build_runner(model, PluginOptions(step_engine="compiled"), 1.0, None)
    runner.units.packages = False  # no unit compiled ahead of time
    if engine == "compiled-exact":
        runner.fast_form = runner.decoder_step.exact
    return runner


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,320")
    parser.add_argument("--engines", default="fairseq,static,compiled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--src-len", type=int, default=16)
    parser.add_argument("--onednn-linear", action="store_true",
                        help="every engine's linear layers through oneDNN's packed product, as --onednn-linear does")
    parser.add_argument("--compiled-max-rows", type=int, default=None,
                        help="rows up to which --step-engine compiled runs its compiled step (more rows: eager "
                             "with oneDNN's products); default: the engine's COMPILED_MAX_ROWS. Run with 1000 and "
                             "with 0 to time the two forms at every row count")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--flop-rate", action="store_true",
                        help="also print each engine's GFLOP/s and that of a plain float32 product of the same "
                             "rows by the vocabulary projection's shape")
    parser.add_argument("--capacity", type=int, default=202,
                        help="target positions a cache holds (fairseq-generate's default --max-len-b 200, bos, eos)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_large_allocations()  # large buffers from the heap, as the generators take them
    if args.compiled_max_rows is not None:
        compiled.COMPILED_MAX_ROWS = compiled.FROZEN_MAX_ROWS = compiled.CUDA_MAX_ROWS = args.compiled_max_rows
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    model = models[0].eval().to(args.device)
    engines = args.engines.split(",")
    runners = {e: make_runner(e, model) for e in engines}
    vocabulary = model.encoder.embed_tokens.num_embeddings
    print(f"ms per step (median of {args.rounds} rounds of {args.steps} steps), {args.threads} thread(s)")
    print("rows  " + "  ".join(f"{e:>10}" for e in engines) + "  " + "  ".join(f"{e + '/fs':>12}" for e in engines[1:]))
    linears = OneDNNLinears(model).attached() if args.onednn_linear else contextlib.nullcontext()
    with torch.inference_mode(), linears:
        for rows in (int(r) for r in args.rows.split(",")):
            src = torch.randint(4, vocabulary, (rows, args.src_len), device=args.device)
            src[:, -1] = 2  # eos
            lengths = torch.full((rows,), args.src_len, device=args.device)
            encoder_out = model.encoder.forward_torchscript({"src_tokens": src, "src_lengths": lengths})
            outputs = {e: run_steps(r, encoder_out, rows, args.steps, args.capacity)[1] for e, r in runners.items()}  # warm-up, compiles
            times = {e: [] for e in engines}
            for _ in range(args.rounds):
                for engine, runner in runners.items():
                    times[engine].append(run_steps(runner, encoder_out, rows, args.steps, args.capacity)[0])
            medians = {e: 1000 * statistics.median(t) for e, t in times.items()}
            same = "  ".join("same" if torch.equal(outputs[e], outputs[engines[0]]) else "tokens differ" for e in engines[1:])
            print(f"{rows:4d}  " + "  ".join(f"{medians[e]:10.2f}" for e in engines) + "  "
                  + "  ".join(f"{medians[engines[0]] / medians[e]:11.2f}x" for e in engines[1:]) + f"  {same}", flush=True)
            if args.flop_rate:
                flops = step_flops(model, rows)
                plain = plain_product_rate(rows, model.decoder.embed_dim, vocabulary, torch.device(args.device),
                                           args.rounds)
                print("      GFLOP/s " + "  ".join(f"{e} {flops / medians[e] / 1e6:.1f}" for e in engines)
                      + f"  (a plain product of the same rows: {plain:.1f})", flush=True)


if __name__ == "__main__":
    main()
