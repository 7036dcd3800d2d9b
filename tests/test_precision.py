"""The mixed-precision policy: built from [training], and the replica-group gradient sum in reduce_dtype."""

import pytest
import torch
from types import SimpleNamespace

from mop_train.parallel.precision import MixedPrecision
from mop_train.parallel.sharding import reduce_replica_grads
from tests.dist_utils import run_distributed
from tests.utils import fresh_seed


def test_policy_from_training_section():
    mp = MixedPrecision.from_training(SimpleNamespace(mixed_precision_param="bfloat16",
                                                      mixed_precision_reduce="float32"))
    assert (mp.param_dtype, mp.reduce_dtype, mp.activation_bytes) == (torch.bfloat16, torch.float32, 2)
    with pytest.raises(ValueError, match="mixed_precision_param = 'float16'"):
        MixedPrecision.from_training(SimpleNamespace(mixed_precision_param="float16",
                                                     mixed_precision_reduce="float32"))
    # The error names the setting that is wrong, so the user knows which one to change.
    with pytest.raises(ValueError, match=r"training.mixed_precision_reduce = 'float16' is not supported"):
        MixedPrecision.from_training(SimpleNamespace(mixed_precision_param="bfloat16",
                                                     mixed_precision_reduce="float16"))


def _reduce_in_bf16(rank, world_size, seed):
    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(seed + r)) for r in range(world_size)]
    param = torch.nn.Parameter(torch.zeros(5, 3))
    param.grad = grads[rank].clone()
    reduce_replica_grads([param], torch.distributed.group.WORLD, reduce_dtype=torch.bfloat16)
    # Gloo sums bf16 tensors pairwise in rank order, rounding each partial sum to bf16.
    want = grads[0].bfloat16()
    for g in grads[1:]:
        want = want + g.bfloat16()
    assert param.grad.dtype == torch.float32
    assert torch.equal(param.grad, want.float()), (param.grad - want.float()).abs().max()
    param.grad = grads[rank].clone()
    reduce_replica_grads([param], torch.distributed.group.WORLD)      # default: the gradient's dtype
    torch.testing.assert_close(param.grad, sum(grads), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_replica_sum_travels_in_reduce_dtype():
    run_distributed(_reduce_in_bf16, 2, fresh_seed(7200))
