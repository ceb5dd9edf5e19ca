"""A compiled step package (AOTInductor ``.pt2``) loaded by torch's C++ loader alone.

``torch._inductor.aoti_load_package`` imports inductor, which imports dynamo: memory wasted in a
process that only loads packages compiled earlier (fairseq-generate with ``--step-engine compiled`` and a warm
package directory) and never compiles.  The C++ loader runs the same compiled code; a package it cannot read
(written by another torch) goes through inductor's loader, which says why.
"""

from pathlib import Path

import torch
from torch.utils import _pytree as pytree


class LoadedPackage:
    """The package's model as a callable of its positional arguments (tensors, lists of tensors, None), as when
    exported.  The engine's steps take and return tensors and flat lists of tensors: they are flattened and
    rebuilt here by hand, since pytree's walk over them is a visible share of a one-row step."""

    def __init__(self, loader):
        self.loader = loader
        self.out_spec = pytree.treespec_loads(loader.get_call_spec()[1])
        self.out_layout = flat_layout(self.out_spec)
        self.constants = None  # the tensors a package compiled without its constants reads (keep_constants)

    def constant_names(self):
        """The names (the exported module's) of the tensors the compiled code reads as constants."""
        return self.loader.get_constant_fqns()

    def keep_constants(self, constants: dict):
        """Read ``constants`` (name -> tensor, every one of ``constant_names``) in place, and keep them."""
        self.loader.load_constants(constants, False, True, True)  # the active buffer, every name, user-managed
        self.constants = constants

    def __call__(self, *args):
        flat = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                flat.append(arg)
            elif arg is not None:
                flat.extend(arg)
        outputs = self.loader.boxed_run(flat)
        if self.out_layout is None:
            return pytree.tree_unflatten(outputs, self.out_spec)
        rebuilt, start = [], 0
        for kind, leaves in self.out_layout:
            rebuilt.append(outputs[start] if kind is None else kind(outputs[start: start + leaves]))
            start += leaves
        return tuple(rebuilt)


def flat_layout(spec):
    """[(None, 1) for a tensor, or (list or tuple, n) for a flat sequence of n tensors] for each item of the
    tuple ``spec`` describes; None for any other structure (then pytree rebuilds it)."""
    if spec.type is not tuple:
        return None
    layout = []
    for child in spec.children():
        if child.is_leaf():
            layout.append((None, 1))
        elif child.type in (list, tuple) and all(c.is_leaf() for c in child.children()):
            layout.append((child.type, child.num_leaves))
        else:
            return None
    return layout


def load_package(path: Path):
    """The callable compiled model of the package at ``path``."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (AttributeError, RuntimeError):
        import torch._inductor as inductor

        return InductorLoaded(inductor.aoti_load_package(str(path)))
    return LoadedPackage(loader)


class InductorLoaded:
    """A package loaded by inductor's loader, with :class:`LoadedPackage`'s methods."""

    def __init__(self, compiled):
        self.compiled, self.constants = compiled, None

    def __call__(self, *args):
        return self.compiled(*args)

    def constant_names(self):
        return self.compiled.get_constant_fqns()

    def keep_constants(self, constants: dict):
        self.compiled.load_constants(constants, check_full_update=True, user_managed=True)
        self.constants = constants
