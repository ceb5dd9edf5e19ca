"""Union of the active vocabularies of the clusters chosen by hidden states.

Entry point: :func:`cluster_union_mask`. CUDA tensors go to the kernels in
``kernels/cluster_union.cu`` (through CuPy); everything else, and CUDA when
CuPy is missing, to the torch reference beside it.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from fairseq_fastgen.ops import _cupy
from fairseq_fastgen.ops._cupy import Launch

KERNEL_FILE = "cluster_union"

_THREADS_PER_BLOCK = 256
_ITEMS_PER_THREAD = 4  # consecutive mask entries each thread of the tile kernels owns
_MOST_MARKING_BLOCKS = 4096  # the marking kernel strides over the states beyond this
_SCAN_BYTES_PER_THREAD = 4  # the tile kernels scan one int per thread in shared memory


class ClusterActiveSets(NamedTuple):
    """Active token ids of every cluster, in CSR form: cluster ``c`` owns
    ``tokens[offsets[c]:offsets[c + 1]]``."""

    offsets: torch.Tensor  # (clusters + 1,) long, non-decreasing, offsets[0] == 0
    tokens: torch.Tensor  # (nnz,) long

    @classmethod
    def from_lists(cls, token_lists: Sequence[Sequence[int]], device=None) -> "ClusterActiveSets":
        """CSR form of one token id list per cluster."""
        lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        tokens = torch.tensor([token for tokens in token_lists for token in tokens], dtype=torch.long)
        return cls(offsets.to(device), tokens.to(device))


def cluster_union_mask(
    chosen_clusters: torch.Tensor, active_sets: ClusterActiveSets, vocab_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The union of the active sets of the chosen clusters.

    chosen_clusters: (states,) long, the nearest centroid of each hidden state.
    active_sets: (offsets, tokens) in CSR form, see :class:`ClusterActiveSets`.

    Returns ``mask`` (vocab_size,) bool, true for every token in the union,
    and ``columns`` (active,) long, the indices where ``mask`` is true in
    ascending order. Both are on the device of ``chosen_clusters``.
    """
    offsets, tokens = active_sets
    _check_arguments(chosen_clusters, offsets, tokens)
    launch = _cupy.launcher_for(chosen_clusters, KERNEL_FILE)
    if launch is None:
        return cluster_union_mask_reference(chosen_clusters, active_sets, vocab_size)
    return cluster_union_mask_with_kernel(chosen_clusters, active_sets, vocab_size, launch)


def cluster_union_mask_reference(
    chosen_clusters: torch.Tensor, active_sets: ClusterActiveSets, vocab_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of :func:`cluster_union_mask`."""
    offsets, tokens = active_sets
    clusters = chosen_clusters.unique()  # (chosen,) each chosen cluster once
    starts = offsets[clusters]  # (chosen,)
    lengths = offsets[clusters + 1] - starts  # (chosen,)
    # entry of every member token: its cluster's start in ``tokens`` plus its rank in the cluster
    first_in_union = lengths.cumsum(0) - lengths  # (chosen,) where each cluster's run begins below
    shift = torch.repeat_interleave(starts - first_in_union, lengths)  # (members,)
    entries = torch.arange(shift.numel(), device=shift.device) + shift  # (members,)
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=chosen_clusters.device)
    mask[tokens[entries]] = True
    return mask, mask.nonzero().squeeze(1)


def cluster_union_mask_with_kernel(
    chosen_clusters: torch.Tensor,
    active_sets: ClusterActiveSets,
    vocab_size: int,
    launch: Launch,
    threads_per_block: Optional[int] = None,
    most_marking_blocks: int = _MOST_MARKING_BLOCKS,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`cluster_union_mask` with the CUDA kernels, started by ``launch``
    (the CuPy launcher, or the CPU emulator's in tests).

    ``threads_per_block`` and ``most_marking_blocks`` override the launch
    shapes, for tests. Reading the number of active tokens waits for the GPU,
    as ``torch.nonzero`` does.
    """
    offsets, tokens = (part.contiguous() for part in active_sets)
    chosen_clusters = chosen_clusters.contiguous()
    device = chosen_clusters.device
    mask = torch.zeros(vocab_size, dtype=torch.uint8, device=device)  # (vocab_size,)
    states = chosen_clusters.numel()
    threads = threads_per_block or _THREADS_PER_BLOCK
    if states > 0 and vocab_size > 0:
        launch(
            "mark_cluster_tokens",
            (min(states, most_marking_blocks),),
            (threads,),
            0,
            chosen_clusters,
            offsets,
            tokens,
            mask,
            np.int32(states),
            np.int32(offsets.numel() - 1),
            np.int32(vocab_size),
        )
    columns = _marked_columns(mask, launch, threads)
    return mask.view(torch.bool), columns


def _marked_columns(mask: torch.Tensor, launch: Launch, threads: int) -> torch.Tensor:
    """The indices of the nonzero entries of the byte mask, ascending."""
    vocab_size = mask.numel()
    tile_size = threads * _ITEMS_PER_THREAD
    tiles = -(-vocab_size // tile_size)
    if tiles == 0:
        return torch.zeros(0, dtype=torch.long, device=mask.device)
    shared_bytes = threads * _SCAN_BYTES_PER_THREAD
    tile_counts = torch.empty(tiles, dtype=torch.long, device=mask.device)  # (tiles,)
    tile_args = (np.int32(vocab_size), np.int32(_ITEMS_PER_THREAD))
    launch("count_marked_tiles", (tiles,), (threads,), shared_bytes, mask, tile_counts, *tile_args)
    tile_ends = tile_counts.cumsum(0)  # (tiles,)
    columns = torch.empty(int(tile_ends[-1]), dtype=torch.long, device=mask.device)  # (active,)
    if columns.numel() > 0:
        tile_offsets = tile_ends - tile_counts  # (tiles,)
        launch("write_marked_columns", (tiles,), (threads,), shared_bytes, mask, tile_offsets, columns,
               np.int64(columns.numel()), *tile_args)
    return columns


def _check_arguments(chosen_clusters: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor) -> None:
    for name, tensor in (("chosen_clusters", chosen_clusters), ("offsets", offsets), ("tokens", tokens)):
        if tensor.dim() != 1 or tensor.dtype != torch.long:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {tuple(tensor.shape)} {tensor.dtype}")
        if tensor.device != chosen_clusters.device:
            raise ValueError(f"{name} is on {tensor.device}, chosen_clusters on {chosen_clusters.device}")
    if offsets.numel() < 1:
        raise ValueError("offsets needs clusters + 1 entries")
