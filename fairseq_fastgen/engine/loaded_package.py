"""A compiled step package (AOTInductor ``.pt2``) loaded by torch's C++ loader alone.

``torch._inductor.aoti_load_package`` imports inductor, which imports dynamo: about 65 MiB of a
process that only loads packages compiled earlier (fairseq-generate with ``--step-engine compiled`` and a warm
package directory) and never compiles.  The C++ loader runs the same compiled code; a package it cannot read
(written by another torch) goes through inductor's loader, which says why.
"""

from pathlib import Path

import torch
from torch.utils import _pytree as pytree


class LoadedPackage:
    """The package's model as a callable of its positional (nested) tensor arguments, as when exported."""

    def __init__(self, loader):
        self.loader = loader
        self.out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args):
        flat = [x for x in pytree.tree_flatten((args, {}))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)


def load_package(path: Path):
    """The callable compiled model of the package at ``path``."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (AttributeError, RuntimeError):
        import torch._inductor as inductor

        return inductor.aoti_load_package(str(path))
    return LoadedPackage(loader)
