"""Let torchtitan 0.2.2 import where Triton is not installed (a CPU install), and say what needs it.

    from mop_train import optional_triton
    optional_triton.install()   # mop_train/__init__.py does this, before anything imports torchtitan

`import torchtitan` runs its package __init__, which imports its quantization converters, which
import its MoE, whose `torchtitan/models/moe/kernels.py` imports `triton` at module level for one
GPU kernel (the token-permutation index fill of its expert-parallel MoE). mop_train uses none of
torchtitan's MoE, and its own Triton kernels (Ring-DTP's) are imported only when they run on CUDA.
So when no `triton` package can be found, `install()` puts a stand-in for that one torchtitan
module into sys.modules; calling either of its functions raises ImportError naming triton. `triton`
itself stays absent, so torch (torch.compile, `has_triton()`) and every other probe see the truth.
With triton installed (GPU machines: CUDA builds of torch depend on it) nothing is changed.
"""

from __future__ import annotations

import importlib.util
import sys
import types

TITAN_KERNELS = "torchtitan.models.moe.kernels"
"""The one torchtitan 0.2.2 module that imports triton at import time (`grep -rn "import triton"`)."""


def _needs_triton(*args, **kwargs):
    raise ImportError(f"{TITAN_KERNELS} needs triton, which is not installed here (a CPU install of mop_train); "
                      f"install it (`pip install -e '.[gpu]'` or `pip install triton`) to use torchtitan's MoE")


def install() -> bool:
    """Put the stand-in in place when triton cannot be found; returns whether it did."""
    if TITAN_KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    module = types.ModuleType(TITAN_KERNELS, "Stand-in for torchtitan's Triton MoE kernels (see "
                                             "mop_train.optional_triton): triton is not installed.")
    module.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    module.generate_permute_indices = module.fill_indices_wrapper = _needs_triton
    sys.modules[TITAN_KERNELS] = module
    return True
