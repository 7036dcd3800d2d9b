import os
import random
import sys

import pytest
import torch

# Tests import the shared helpers as `from tests.utils import ...` / `from tests.dist_utils import ...`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mop_train  # noqa: E402,F401  (before any test imports torchtitan: a CPU install has no triton)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_configure(config):
    # One base seed per session, exported so that spawned ranks see it (tests.utils.fresh_seed).
    from tests.utils import SEED_ENV
    os.environ.setdefault(SEED_ENV, str(random.SystemRandom().randrange(1 << 31)))


def pytest_report_header(config):
    from tests.utils import SEED_ENV
    return f"random inputs: {SEED_ENV}={os.environ[SEED_ENV]} (set it to reproduce this session)"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Also under -q (no header): a failure on fresh inputs must say how to get them back.
    from tests.utils import SEED_ENV
    terminalreporter.write_line(f"random inputs of this session: {SEED_ENV}={os.environ[SEED_ENV]}")
