"""SCO against plain checkpointing when a boundary is modified in place before backward (found
2026-12-07).

Plain non-reentrant checkpointing saves the layer's input through autograd, whose version check
raises at backward if the input was changed in place since. SCO's saved-tensor hook bypassed that
check: a boundary kept on the device (budget 0, or one that does not fit) was recomputed from its new
values and the gradients were silently wrong. Now SCO raises the same RuntimeError, for kept and
offloaded boundaries alike; untouched boundaries still give plain checkpointing's gradients bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mop_train.ops.sco import SelectiveCheckpointOffload, checkpointed
from tests.utils import assert_bitwise_equal, fresh_seed

H = 8


class _Layer(nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H, generator=gen) / H ** 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.w.t()) * x


def _wrapped(kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layers = [_Layer(gen) for _ in range(3)]
    if kind == "plain":
        return layers, [checkpointed(layer) for layer in layers]
    budget = {"kept": 0, "offloaded": 1 << 20, "mixed": 5 * H * 4}[kind]   # mixed: the first boundary only
    sco = SelectiveCheckpointOffload(budget)
    return layers, [sco.wrap(layer) for layer in layers]


@pytest.mark.parametrize("kind", ["plain", "kept", "offloaded", "mixed"])
@pytest.mark.parametrize("modified", [0, 1, 2])
def test_in_place_change_of_a_boundary_raises_as_plain_checkpointing(kind, modified):
    seed = fresh_seed(7201)
    layers, wrapped = _wrapped(kind, seed)
    x0 = torch.randn(5, H, generator=torch.Generator().manual_seed(seed + 1), requires_grad=True)
    h, boundaries = x0 * 1.0, []
    for layer in wrapped:
        boundaries.append(h)
        h = layer(h)
    with torch.no_grad():
        boundaries[modified].mul_(3.0)   # the saved input changes after its layer's forward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


@pytest.mark.parametrize("kind", ["kept", "offloaded", "mixed"])
def test_untouched_boundaries_keep_plain_gradients_bitwise(kind):
    seed = fresh_seed(7202)
    grads = {}
    for which in ("plain", kind):
        layers, wrapped = _wrapped(which, seed)
        x0 = torch.randn(5, H, generator=torch.Generator().manual_seed(seed + 1), requires_grad=True)
        h = x0 * 1.0
        for layer in wrapped:
            h = layer(h)
        (h * torch.linspace(-1, 1, H)).sum().backward()
        grads[which] = [x0.grad] + [layer.w.grad for layer in layers]
    for i, (a, b) in enumerate(zip(grads[kind], grads["plain"])):
        assert_bitwise_equal(a, b, name=f"{kind} grad {i}")
