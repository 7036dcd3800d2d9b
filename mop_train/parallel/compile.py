"""torch.compile of the decoder's blocks and of the loss ([compile] enable, components, backend).

    options = CompileOptions.from_config(cfg.compile)          # None when compile.enable is false
    apply_compile(module, options, device_type="cuda")          # after checkpointing, before FSDP2

Per block, as torchtitan 0.2.2 compiles its MoE models (`models/llama4/infra/parallelize.py`
apply_compile, which DeepSeek-V3 reuses; taken as the model, not copied): each block is compiled
on its own, so the compiled code of one block serves every block of the same structure, and the
compiled region sits inside the activation-checkpoint wrapper (the wrapper, SCO's saved-tensor
hooks and FSDP2's hooks stay eager around it). What a block does that the compiler must not trace
runs eagerly, as a graph break (`EAGER_SUBMODULES`): the attention core (Ulysses' all-to-all
autograd Function, kept attention's autograd Function, the document mask's FlexAttention, or one
SDPA kernel) and the experts' dispatch seam (every schedule's collectives and autograd Functions,
LLEP's weight migration, PipelinedLLEP's chunk Functions; the local path's grouped GEMM, whose
group sizes are data). Everything else of the block (norms, projections, RoPE, router, shared
expert, dense FFN, residuals) is compiled, except the stages [mop.tiling] runs over token tiles
(mop_train.ops.tiling's `tiled_rows`, compiler-disabled there). The loss component compiles the chunked
cross-entropy; Ring-DTP is refused for it at config time (it is its own kernels and collectives).

Compiling changes neither the module tree nor the state-dict names (the compiled callable replaces
the module's `forward` on the instance), so checkpoints move freely between compiled and eager runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

COMPONENTS = ("model", "loss")
"""What `[compile] components` may list (torchtitan's names)."""

EAGER_SUBMODULES = ("attention.sdpa", "moe.experts")
"""Submodules of a block run eagerly inside its compiled forward (see the module docstring)."""


@dataclass(frozen=True)
class CompileOptions:
    """Which components torch.compile wraps, and with which backend."""

    model: bool                 # every block of model.layers
    loss: bool                  # the loss function of the FSDP root (chunked cross-entropy)
    backend: str                # a torch._dynamo backend name ("inductor", "aot_eager", ...)

    @classmethod
    def from_config(cls, compile_cfg) -> CompileOptions | None:
        """From torchtitan's `[compile]` section (checked in mop_train.config_checks); None when off."""
        if not compile_cfg.enable:
            return None
        return cls(model="model" in compile_cfg.components, loss="loss" in compile_cfg.components,
                   backend=compile_cfg.backend)


def check_compiler(backend: str, device_type: str) -> None:
    """Raise ValueError when `backend` cannot build code on `device_type` here: inductor on CPU
    writes C++ and needs a C++ compiler (inductor on CUDA writes Triton, a dependency)."""
    if backend != "inductor" or device_type != "cpu":
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as err:  # inductor raises its own InvalidCxxCompiler
        raise ValueError(f"compile.backend = 'inductor' on CPU needs a C++ compiler (g++ or clang++, or "
                         f"$CXX) and found none ({type(err).__name__}); install one, or set "
                         f"compile.enable = false") from None


_EAGER_CLASSES: dict[type, type] = {}


def _eager(module: nn.Module) -> None:
    """Make `module`'s forward a graph break: it, and all it calls, run without the compiler.

    The module's class is swapped for a subclass (one per class) whose forward is disabled, so every
    block sees the same function and the blocks share one compiled entry (an instance attribute
    would be a new function per block, each a recompile). State-dict names and isinstance checks
    are unchanged."""
    cls = type(module)
    if cls in _EAGER_CLASSES.values():
        return
    if cls not in _EAGER_CLASSES:
        _EAGER_CLASSES[cls] = type(f"Eager{cls.__name__}", (cls,),
                                   {"forward": torch.compiler.disable(cls.forward, recursive=True)})
    module.__class__ = _EAGER_CLASSES[cls]


def compile_block(block: nn.Module, backend: str) -> nn.Module:
    """Compile `block` (or, for a checkpoint / SCO wrapper, the block it wraps) in place, with the
    `EAGER_SUBMODULES` it holds left eager; returns the compiled module. ([mop.tiling]'s tiled stages
    are a graph break of their own: mop_train.ops.tiling's `tiled_rows` is compiler-disabled.)"""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    for path in EAGER_SUBMODULES:
        owner, _, name = path.rpartition(".")
        parent = getattr(inner, owner, None)
        if parent is not None and isinstance(getattr(parent, name, None), nn.Module):
            _eager(getattr(parent, name))
    inner.forward = torch.compile(inner.forward, backend=backend)
    return inner


def apply_compile(module: nn.Module, options: CompileOptions, *, device_type: str) -> None:
    """Compile `module.model`'s blocks and/or `module.loss_fn` (mop_train.train.loss.LanguageModelLoss).

    Call after activation checkpointing and before FSDP2 (parallelize's order), so that the
    compiled region is the block's own computation. Raises ValueError when the backend cannot run here.
    """
    check_compiler(options.backend, device_type)
    if options.model:
        for block in module.model.layers.values():
            compile_block(block, options.backend)
    if options.loss:
        module.loss_fn = torch.compile(module.loss_fn, backend=options.backend)
