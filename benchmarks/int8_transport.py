"""A fairseq checkpoint as int8 parts small enough to leave a GPU machine, and back (not part of the product).

    python benchmarks/int8_transport.py pack CKPT DIR NAME [--only-prefix decoder.heads.] [--part-mib 16]
    python benchmarks/int8_transport.py unpack DIR NAME DST [--base CKPT]

A model trained on a lent GPU comes back through a channel of a few files of 16 MiB (benchmarks/gpu.sh); a
base-size model is 240 MB in float32. ``pack`` rounds every matrix to int8 with one float32 scale per row (its
largest magnitude over 127) and keeps vectors (biases, layer norms) in float32; it writes NAME.meta.pt (the
checkpoint without its weights or optimizer state) and NAME.partN.pt files of at most ``--part-mib`` each (16 MiB).
A matrix larger than a part goes in blocks of rows. ``unpack`` writes the checkpoint whose weights are the rounded ones, in float32: a model of its own, whose
rounding ``pack`` reports. The arithmetic of ``unpack`` runs on the CPU, so the GPU machine (which unpacks its own
parts to train students on the rounded base) and this machine get bitwise the same weights.

``--only-prefix`` packs the weights under one prefix (a k-head student's heads, ``decoder.heads.``); ``unpack
--base`` takes every other weight from a checkpoint (the rounded base the frozen student was trained on).
"""

import argparse
from pathlib import Path

import torch

MiB = 1 << 20


def quantize(tensor: torch.Tensor):
    """(int8 values, float32 row scales) of a matrix; a vector or an integer tensor as it is."""
    if tensor.dim() < 2 or not tensor.is_floating_point():
        return tensor.float() if tensor.is_floating_point() else tensor
    rows = tensor.float().reshape(tensor.shape[0], -1)  # (out, in)
    scale = (rows.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # (out,)
    values = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return values.reshape(tensor.shape), scale


def dequantize(packed) -> torch.Tensor:
    if not isinstance(packed, tuple):
        return packed
    values, scale = packed
    return (values.float().reshape(values.shape[0], -1) * scale[:, None]).reshape(values.shape)


def nbytes(packed) -> int:
    """Bytes of a packed tensor in a part: its values, and a kilobyte of the file's records per tensor."""
    parts = packed if isinstance(packed, tuple) else (packed,)
    return sum(part.numel() * part.element_size() + 1024 for part in parts)


def row_blocks(key, packed, budget):
    """(key, first row, packed rows) pieces of a packed tensor, each of at most ``budget`` bytes where rows allow."""
    if not isinstance(packed, tuple) or nbytes(packed) <= budget:
        return [(key, 0, packed)]
    values, scale = packed
    rows = max(1, budget // nbytes((values[:1], scale[:1])))
    return [(key, start, (values[start:start + rows].clone(), scale[start:start + rows].clone()))  # not the whole
            for start in range(0, values.shape[0], rows)]                                             # storage


def pack(checkpoint, directory, name, only_prefix=None, part_mib=16.0):
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)  # your own checkpoint
    weights = {key: value for key, value in state["model"].items() if only_prefix is None or key.startswith(only_prefix)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    budget = int(part_mib * MiB * 15 / 16)  # a sixteenth left for pickling
    parts, part, size, worst = [], [], 0, 0.0
    aliases, packed_keys = {}, []  # a tied weight (shared embeddings: saved as equal copies on CUDA) travels once
    for key, value in weights.items():
        twin = next((other for other in packed_keys if weights[other].shape == value.shape
                     and weights[other].dtype == value.dtype and torch.equal(weights[other], value)), None)
        if twin is not None and value.dim() >= 2:
            aliases[key] = twin
            continue
        packed_keys.append(key)
        packed = quantize(value)
        if isinstance(packed, tuple):
            error = (dequantize(packed) - value.float()).abs().max().item()
            worst = max(worst, error / max(value.float().abs().max().item(), 1e-12))
        for piece in row_blocks(key, packed, budget):
            if part and size + nbytes(piece[2]) > budget:
                parts.append(part)
                part, size = [], 0
            part.append(piece)
            size += nbytes(piece[2])
    parts.append(part)
    meta = {key: value for key, value in state.items() if key not in ("model", "last_optimizer_state")}
    meta.update(parts=len(parts), aliases=aliases, only_prefix=only_prefix)
    torch.save(meta, directory / f"{name}.meta.pt")
    for index, part in enumerate(parts):
        torch.save(part, directory / f"{name}.part{index}.pt")
    total = sum((directory / f"{name}.part{index}.pt").stat().st_size for index in range(len(parts)))
    print(f"{name}: {len(weights)} tensors in {len(parts)} parts, {total / MiB:.1f} MiB; largest rounding error "
          f"{worst:.2e} of a matrix's largest weight")


def unpack(directory, name, destination, base=None):
    directory = Path(directory)
    meta = torch.load(directory / f"{name}.meta.pt", map_location="cpu", weights_only=False)
    weights = {}
    if base is not None:
        weights.update(torch.load(base, map_location="cpu", weights_only=False)["model"])
    blocks = {}  # key -> [(first row, tensor)]
    for index in range(meta.pop("parts")):
        for key, start, packed in torch.load(directory / f"{name}.part{index}.pt", map_location="cpu",
                                             weights_only=False):
            blocks.setdefault(key, []).append((start, dequantize(packed)))
    for key, pieces in blocks.items():
        weights[key] = torch.cat([tensor for _, tensor in sorted(pieces, key=lambda piece: piece[0])])
    for key, original in meta.pop("aliases").items():
        weights[key] = weights[original]
    meta.pop("only_prefix")
    torch.save(dict(meta, model=weights, last_optimizer_state=None), destination)
    print(f"{destination}: {len(weights)} tensors")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pack_parser = commands.add_parser("pack")
    pack_parser.add_argument("checkpoint")
    pack_parser.add_argument("directory")
    pack_parser.add_argument("name")
    pack_parser.add_argument("--only-prefix")
    pack_parser.add_argument("--part-mib", type=float, default=16.0, help="the largest part, in MiB")
    unpack_parser = commands.add_parser("unpack")
    unpack_parser.add_argument("directory")
    unpack_parser.add_argument("name")
    unpack_parser.add_argument("destination")
    unpack_parser.add_argument("--base")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.checkpoint, args.directory, args.name, args.only_prefix, args.part_mib)
    else:
        unpack(args.directory, args.name, args.destination, args.base)


if __name__ == "__main__":
    main()
