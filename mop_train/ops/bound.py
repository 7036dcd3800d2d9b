"""The one shape of an operator's memory bound, the unit the memory plan (mop_train.plan) sums.

Every operator (and every bounded live set the plan counts) has, beside its code, a function

    device_bound(options, shapes) -> DeviceBound

whose `options` are the operator's own typed settings and `shapes` the sizes it is applied to on
this rank. It returns the device bytes the operator holds at its peak, split in two because the
plan places them at different moments of the step:

  saved    bytes held from the operator's forward until its backward (or all step): they add up
           over the layers that ran before the peak;
  working  bytes alive only while the operator itself runs (buffers, chunks, staging): only the
           operator running at the peak contributes them.

`how` is the formula in words, printed on the plan's line. A bound is an upper bound on what the
operator allocates beyond its inputs, checked on CPU by each operator's tests against its own
counters, and on GPU against torch.cuda.max_memory_allocated (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceBound:
    """Device bytes an operator holds at its peak: `saved` across its forward and backward,
    `working` while it runs, and the formula that gave them."""

    saved: int
    working: int
    how: str

    def __post_init__(self):
        if self.saved < 0 or self.working < 0:
            raise ValueError(f"a bound's bytes must be >= 0, got saved={self.saved}, working={self.working} "
                             f"({self.how})")

    @property
    def device_bytes(self) -> int:
        return self.saved + self.working
