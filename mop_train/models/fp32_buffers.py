"""A module mixin whose named buffers stay fp32 (with their exact values) under `.to(dtype)`.

`model.to(torch.bfloat16)` would otherwise round the router's balancing bias (which then cannot
absorb small updates) and RoPE's inverse frequencies. Device moves and `to_empty` pass through.
"""

from __future__ import annotations

import torch
from torch import nn


class KeepFp32Buffers(nn.Module):
    """Subclasses list the buffers to protect in `fp32_buffers`."""

    fp32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers[name] for name in self.fp32_buffers if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                # Re-derive from the fp32 original on the new device instead of the rounded copy.
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self
