"""DeviceCount (mop_train.train.device_count): sums added on the device equal the plain sum, read once."""

import pytest
import torch

from mop_train.train.device_count import DeviceCount
from tests.utils import fresh_seed


def test_device_count_sums_what_it_was_given():
    gen = torch.Generator().manual_seed(fresh_seed(4101))
    counts = torch.randint(0, 1 << 40, (17,), generator=gen)
    times = torch.randint(1, 65, (17,), generator=gen).tolist()
    total = DeviceCount(int(counts[0]))
    expected = int(counts[0])
    for n, t in zip(counts[1:], times[1:]):
        total.add(n.clone(), t)                 # a 0-dim int64 tensor, as the loop's all-reduce leaves it
        expected += int(n) * t
    total.add(3, 2)                             # a plain int is summed on the host
    expected += 6
    assert total.value == expected and total.value == expected   # a second read reads nothing new
    total.add(torch.tensor(5, dtype=torch.int32))
    assert total.value == expected + 5
    total.value = 7
    total.add(torch.tensor(1))
    assert total.value == 8


@pytest.mark.parametrize("bad", [torch.tensor(1.0), torch.tensor([1, 2])], ids=["float", "1-dim"])
def test_device_count_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match="0-dim integer tensor"):
        DeviceCount().add(bad)
