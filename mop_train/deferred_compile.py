"""Defer the three `torch.compile` wrappers torchtitan 0.2.2 builds at import time to their first call.

    from mop_train import deferred_compile
    deferred_compile.install()   # mop_train/__init__.py does this, before anything imports torchtitan

`import torchtitan` runs its package __init__, which reaches `torchtitan/models/attention.py`; that
module calls `torch.compile` three times at import (VarlenAttentionWrapper._compiled_varlen_attn,
FlexAttentionWrapper._compiled_flex_attn, _compiled_create_block_mask). Building those wrappers
imports TorchInductor (`torch._inductor.compile_fx` and its lowerings): about 3 s of CPU per process
on import and teardown, a quarter of a `torchrun -m mop_train.train` rank's start on CI's CPU, paid by
every rank of every launch although mop_train calls none of the three (its attention is its own:
mop_train/models/attention_backends.py, document_mask.py).

`install()` puts a finder in `sys.meta_path` that, while that one module executes, replaces
`torch.compile` by `deferred`, which returns a function that calls the real `torch.compile(fn,
**options)` on its first call and the compiled callable from then on; `torch.compile` is restored as
soon as the module has run. So the three names hold plain functions (bound and called as before) and
Inductor is imported only when one of them runs. Nothing else is changed: every other module,
torchtitan's included, sees the real `torch.compile`.
Model: mop_train/optional_triton.py (the other torchtitan import-time stand-in).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

TITAN_ATTENTION = "torchtitan.models.attention"
"""The torchtitan 0.2.2 module that calls torch.compile at import (`grep -rn "= torch.compile"`)."""


def deferred(real_compile):
    """A stand-in for `torch.compile(fn, **options)`: compile on the first call (`real_compile`)."""
    def compile_later(fn=None, **options):
        if fn is None:   # the decorator form, torch.compile(**options)(fn)
            return lambda f: compile_later(f, **options)
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(real_compile(fn, **options))
            return compiled[0](*args, **kwargs)
        call.deferred_compile_options = options
        return call
    return compile_later


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch
        real = torch.compile
        torch.compile = deferred(real)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TITAN_ATTENTION:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> bool:
    """Put the finder first in sys.meta_path (once, and only before torchtitan's attention module is
    imported); returns whether it did."""
    if TITAN_ATTENTION in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder())
    return True
