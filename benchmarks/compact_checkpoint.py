"""A small copy of a fairseq checkpoint, for moving it to another machine (not part of the product).

    python benchmarks/compact_checkpoint.py SRC DST [--half] [--strip-kheads]

Drops the optimizer state. ``--half`` stores the floating-point weights in float16; fairseq loads them
into the model's float32 parameters, so the copy decodes as a float32 model whose weights are rounded to
float16 (a model of its own: compare decoders on the same copy, not with the original). ``--strip-kheads``
turns a ``transformer_khead`` checkpoint into a stock ``transformer`` one: the k-head layer is dropped and
the body kept (stock fairseq, CTranslate2 and beam search then load it).
"""

import argparse

import torch

KHEAD_PREFIX = "decoder.heads."  # the k-head layer's parameters (fairseq_fastgen/models/transformer_khead.py)


def compact(state: dict, half: bool, strip_kheads: bool) -> dict:
    state = dict(state, last_optimizer_state=None)
    weights = state["model"]
    if strip_kheads:
        weights = {name: tensor for name, tensor in weights.items() if not name.startswith(KHEAD_PREFIX)}
        model_cfg = state["cfg"]["model"]
        model_cfg._name = model_cfg.arch = "transformer"
    if half:
        weights = {name: tensor.half() if tensor.is_floating_point() else tensor for name, tensor in weights.items()}
    state["model"] = weights
    return state


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--half", action="store_true", help="store floating-point weights in float16")
    parser.add_argument("--strip-kheads", action="store_true", help="transformer_khead -> stock transformer")
    args = parser.parse_args()
    state = torch.load(args.src, map_location="cpu", weights_only=False)  # your own checkpoint
    torch.save(compact(state, args.half, args.strip_kheads), args.dst)


if __name__ == "__main__":
    main()
