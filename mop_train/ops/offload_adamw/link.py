"""What one training step moves over the host link for OffloadStreamAdamW, counted where it is copied.

Three sources, each counted in bytes both ways (h2d: host -> device, d2h: device -> host):
  optimizer  the step (bucket_step.py, host_update.py): the streamed buckets' master and moments
             (12 B/element each way, whole buckets), the per-parameter step counts (4 B each, up),
             streamed gradients read back (gradients = "stream": 4 B/element up), working weights
             refreshed into host memory (weights = "stream": the working dtype's bytes down), and
             the CPU share's gradients down, its first-update weights down and its weights up
             (when the working weights are on the device);
  windows    weights = "stream": every block copied into a window slot (weight_windows.py), in the
             forward, the recompute and backward, at the working dtype's bytes (FSDP2's padding
             included: it is copied);
  gradients  gradients = "stream" (grad_stream.py): every gradient's running sum going to the host
             after each micro-batch's backward (4 B/element) and, from the second micro-batch on,
             the previous sum read back (4 B/element up).
A copy's bytes are those of its host-side tensor: every copy is non_blocking, so torch converts
dtypes on the device (Copy.cpp), and the link carries the host tensor's dtype. A CPU-only build
runs the same copies in host memory and counts them as a CUDA build would cross the link.
Not counted: start-up and checkpoint loads (`refresh_working`), the loop's scalars and input
tokens, SCO's activations (its own `sco_host_bytes`).
One account is open at a time; `OffloadStreamAdamW.step()` closes it (`LinkBytes`, kept as
`link_bytes()`), so each account is one optimizer step: its micro-batches' forwards and backwards
and the step itself. A step the loop skips (non-finite) is closed by `close_link_account()`.
`OffloadStepStats` keeps the account with the step's other counts (`OffloadStreamAdamW.last_step`).
Model: none of DeepSpeed's ZeRO-Offload / ZeRO-Infinity, FSDP2's CPUOffloadPolicy or torchtitan counts
its transfers per step; the per-copy count is ours (tests/train/test_offload_streaming_gpu.py checks it
against every cross-device copy recorded on CUDA).
Legend: h2d host -> device, d2h device -> host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("optimizer", "windows", "gradients")
FP32_STEP_BYTES = 4  # a parameter's step count (torch keeps fp32 steps), copied up every step
GIB = 2**30


def host_bytes(tensor) -> int:
    """Bytes a non_blocking copy to or from this host-side tensor moves over the link."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class LinkBytes:
    """One step's bytes per source and direction: h2d[source], d2h[source]."""

    h2d: dict = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    d2h: dict = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))

    @property
    def h2d_total(self) -> int:
        return sum(self.h2d.values())

    @property
    def d2h_total(self) -> int:
        return sum(self.d2h.values())

    @classmethod
    def summed(cls, accounts) -> "LinkBytes":
        """The accounts of several optimizers (one per model part) as one."""
        return cls({k: sum(a.h2d[k] for a in accounts) for k in SOURCES},
                   {k: sum(a.d2h[k] for a in accounts) for k in SOURCES})

    def metrics(self) -> dict:
        """metrics.jsonl fields in GiB (bytes / 2**30: exact in a float for any real count)."""
        out = {"offload_h2d_gib": self.h2d_total / GIB, "offload_d2h_gib": self.d2h_total / GIB}
        for source in SOURCES:
            out[f"offload_h2d_gib_{source}"] = self.h2d[source] / GIB
            out[f"offload_d2h_gib_{source}"] = self.d2h[source] / GIB
        return out


class LinkCounter:
    """The open account: `add(source, h2d=..., d2h=...)` at each copy, `close()` at the step's end."""

    def __init__(self):
        self._h2d, self._d2h = dict.fromkeys(SOURCES, 0), dict.fromkeys(SOURCES, 0)

    def add(self, source: str, *, h2d: int = 0, d2h: int = 0) -> None:
        if source not in self._h2d:
            raise ValueError(f"link source {source!r} is not one of {SOURCES}")
        self._h2d[source] += h2d
        self._d2h[source] += d2h

    def close(self) -> LinkBytes:
        """The account so far; a new one opens (all zero)."""
        done = LinkBytes(dict(self._h2d), dict(self._d2h))
        self._h2d, self._d2h = dict.fromkeys(SOURCES, 0), dict.fromkeys(SOURCES, 0)
        return done


@dataclass
class OffloadStepStats:
    """What the last step moved (its duration: `step_seconds()`; what it held back: `exposed_seconds()`).
    h2d_bytes / d2h_bytes: the step's own copies over the host link; `link`: the whole account of
    the step (its forwards' and backwards' weight windows and streamed gradients too; LinkBytes)."""

    buckets: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    params_updated: int = 0
    host_updated_elements: int = 0    # elements of the flat state updated on the CPU
    device_updated_elements: int = 0  # elements of the device-resident share (updated in place)
    link: LinkBytes = field(default_factory=LinkBytes)
