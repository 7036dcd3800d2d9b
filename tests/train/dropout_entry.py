"""Test-only launch of the real training entry with a model that draws from the RNG every step.

    torchrun --standalone --nproc_per_node=2 tests/train/dropout_entry.py --job.config_file ... [flags]

mop_train's models have no dropout, so nothing they do during steps reads the torch CPU generator
and a resume that restored it wrong would still repeat the losses. This entry adds dropout (p =
DROPOUT, in training mode) to the token embeddings' output of the model `build_run` builds, then runs
`mop_train.train.__main__.run` unchanged: the same launch, checkpoint and resume code paths, now
with masks drawn from the generator at every step (outside the checkpointed blocks, so the
recompute draws nothing). A resumed run repeats the uninterrupted run's losses only if every
rank's generator continues exactly where the checkpoint saved it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.nn.functional as F  # noqa: E402

from mop_train.train import build  # noqa: E402
from mop_train.train.__main__ import leave, run  # noqa: E402

DROPOUT = 0.1


def _with_dropout(build_model):
    def build_model_with_dropout(*args, **kwargs):
        parts = build_model(*args, **kwargs)
        parts.model.tok_embeddings.register_forward_hook(
            lambda module, inputs, out: F.dropout(out, DROPOUT, training=True))
        return parts
    return build_model_with_dropout


if __name__ == "__main__":
    build.build_model = _with_dropout(build.build_model)
    leave(run())
