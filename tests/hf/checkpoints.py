"""A random model of the MLA family saved as a DCP checkpoint in this process (tests of mop_train.hf)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.distributed.checkpoint as dcp

from mop_train.models import zoo
from mop_train.models.model import MoETransformer
from mop_train.train import integrity


def random_model(args, seed: int, bias_std: float = 0.05) -> MoETransformer:
    """The zoo's init at `seed`, with router biases drawn too (a trained model's are not zero)."""
    torch.manual_seed(seed)
    model = zoo.build_model(args)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.expert_bias.normal_(0.0, bias_std)
    return model


def save_dcp(model: torch.nn.Module, folder: str) -> str:
    """The model's state dict as a one-process DCP checkpoint with its manifest, like a run's step folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "torch.distributed is disabled ... single process"
        dcp.save(model.state_dict(), checkpoint_id=folder, no_dist=True)
    integrity.write_manifest(folder, rank=0, world=1)
    return folder


def debug_args(**changes):
    return replace(zoo.get_model_args("debug"), **changes)
