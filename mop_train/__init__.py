"""mop_train: MoE pretraining with bounded per-rank memory peaks, on torchtitan 0.2.2."""

from mop_train import deferred_compile, optional_triton

__version__ = "0.1.0"

optional_triton.install()   # torchtitan imports triton at import time; a CPU install has none
deferred_compile.install()  # ... and builds three torch.compile wrappers (Inductor's import) it never needs here
