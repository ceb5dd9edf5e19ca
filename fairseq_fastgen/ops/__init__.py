"""Custom ops for decoding, each with a torch reference.

Every GPU op has one entry point that runs a CUDA kernel from ``kernels/*.cu``
(loaded with CuPy) on CUDA tensors and its torch reference otherwise; CuPy is
imported only when a CUDA tensor arrives. ``_emulator`` runs the same kernel
sources on the CPU for tests.  One CPU op, :func:`onednn_linear`
(``--onednn-linear``), computes ``F.linear`` through oneDNN's packed weights.
"""

from fairseq_fastgen.ops.cache_reorder import reorder_beam_cache, shrink_shared_cache
from fairseq_fastgen.ops.cluster_union import ClusterActiveSets, cluster_union_mask
from fairseq_fastgen.ops.ngram_ban import ban_repeated_ngrams
from fairseq_fastgen.ops.onednn_linear import onednn_linear

__all__ = [
    "ClusterActiveSets",
    "ban_repeated_ngrams",
    "cluster_union_mask",
    "onednn_linear",
    "reorder_beam_cache",
    "shrink_shared_cache",
]
