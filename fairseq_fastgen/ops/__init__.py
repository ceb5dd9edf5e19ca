"""Custom GPU ops for decoding, each with a torch reference.

Every op has one entry point that runs a CUDA kernel from ``kernels/*.cu``
(loaded with CuPy) on CUDA tensors and its torch reference otherwise; CuPy is
imported only when a CUDA tensor arrives. ``_emulator`` runs the same kernel
sources on the CPU for tests.
"""

from fairseq_fastgen.ops.cache_reorder import reorder_beam_cache, shrink_shared_cache
from fairseq_fastgen.ops.cluster_union import ClusterActiveSets, cluster_union_mask
from fairseq_fastgen.ops.ngram_ban import ban_repeated_ngrams

__all__ = [
    "ClusterActiveSets",
    "ban_repeated_ngrams",
    "cluster_union_mask",
    "reorder_beam_cache",
    "shrink_shared_cache",
]
