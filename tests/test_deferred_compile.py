"""mop_train.deferred_compile: torchtitan's import-time torch.compile wrappers compile on first call.

Checks: the stand-in compiles once, at the first call, with the options it was given, and returns what
the compiled function returns (a recording compile, then the real torch.compile with the eager
backend on random inputs); torchtitan's three wrappers are deferred ones carrying torchtitan's own
options; `torch.compile` is the real one afterwards; and a fresh `import mop_train, torchtitan`
(what every training rank does) no longer imports TorchInductor.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from mop_train import deferred_compile
from tests.utils import fresh_seed


def test_compiles_once_at_the_first_call_with_the_given_options():
    calls = []

    def recording_compile(fn, **options):
        calls.append(options)
        return lambda *args: ("compiled", fn(*args))

    later = deferred_compile.deferred(recording_compile)
    add = later(lambda a, b: a + b, mode="max-autotune-no-cudagraphs")
    assert calls == []
    assert add(2, 3) == ("compiled", 5) and add(4, 5) == ("compiled", 9)
    assert calls == [{"mode": "max-autotune-no-cudagraphs"}]
    decorated = later(dynamic=False)(lambda a: a * 2)      # the decorator form
    assert decorated(7) == ("compiled", 14) and calls[-1] == {"dynamic": False}


def test_real_compile_gives_the_same_values():
    g = torch.Generator().manual_seed(fresh_seed(91))
    x = torch.randn(5, 7, generator=g)

    def f(t):
        return torch.tanh(t) * t.sum(-1, keepdim=True)

    later = deferred_compile.deferred(torch.compile)(f, backend="eager")
    torch.testing.assert_close(later(x), f(x), rtol=0, atol=0)


def test_torchtitan_wrappers_are_deferred_and_torch_compile_is_restored():
    from torchtitan.models import attention
    assert torch.compile.__module__ == "torch"
    assert attention.VarlenAttentionWrapper._compiled_varlen_attn.deferred_compile_options == {
        "mode": "max-autotune-no-cudagraphs"}
    assert attention.FlexAttentionWrapper._compiled_flex_attn.__wrapped__ is attention.flex_attention
    assert attention._compiled_create_block_mask.__wrapped__ is attention.create_block_mask


def test_a_fresh_torchtitan_import_leaves_inductor_out():
    code = ("import sys, mop_train, torchtitan.config; import torch; "
            "print('torch._inductor.compile_fx' in sys.modules, torch.compile.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "torch"], out.stdout + out.stderr
