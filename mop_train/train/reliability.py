"""What keeps a long run honest: non-finite steps, clean stops, orphaned ranks, one writer per folder.

    guard = NonFiniteGuard(cfg.mop.reliability, rank=rank, world=W, device=device)
    verdict = guard.check(loss, grad_norm, stop_requested=stop.requested)  # same on every rank
    guard.after(verdict, step=step, named_params=named_params)  # counts a skip, or raises

One all-reduce per step of a [3, W] flag tensor tells every rank, in the same step, which ranks saw
a non-finite loss or gradient norm and which were asked to stop (SIGTERM). A non-finite step
updates nothing (parameters, optimizer state, LR schedule position, router biases); after
`max_consecutive_skips` of them in a row, or at the first with on_nonfinite = "stop", training
stops with EXIT_NONFINITE, naming the step, the ranks and the first parameter (in model order)
whose gradient is non-finite. Each distinct way of stopping has its own exit code (below).

Legend: W ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mop_train.parallel.sharding import local

EXIT_CONFIG = 2        # a configuration or input error (printed once, by rank 0)
EXIT_NONFINITE = 3     # non-finite loss / gradients (on_nonfinite = "stop", or too many skips in a row)
EXIT_CHECKPOINT = 4    # a damaged, incomplete or non-finite checkpoint, or a non-finite state not saved
EXIT_STOPPED = 5       # SIGTERM: stopped at a step boundary (after saving, when configured)
EXIT_HUNG = 6          # a collective did not complete within comm.train_timeout_seconds
EXIT_LOCKED = 7        # another live job holds the dump folder


class TrainingStop(Exception):
    """Ends training with `exit_code`. `agreed`: every rank raises it with the same message after
    a collective decision (an all-reduce or a broadcast), so rank 0 alone prints it and the others
    leave at once; otherwise a rank other than 0 waits before printing (mop_train.train.__main__).
    `every_rank`: a message that differs by rank, printed by each."""

    exit_code = 1
    every_rank = False
    agreed = False

    def __init__(self, message: str, exit_code: int | None = None, *, agreed: bool | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        if agreed is not None:
            self.agreed = agreed


class NonFiniteError(TrainingStop):
    exit_code = EXIT_NONFINITE
    agreed = True          # from the all-reduced step verdict


class CheckpointError(TrainingStop):
    exit_code = EXIT_CHECKPOINT


class StopRequested(TrainingStop):
    exit_code = EXIT_STOPPED
    agreed = True          # from the all-reduced step verdict


class DumpFolderLocked(TrainingStop):
    exit_code = EXIT_LOCKED
    agreed = True          # rank 0's outcome, broadcast


class CollectiveTimeout(TrainingStop):
    exit_code = EXIT_HUNG
    every_rank = True


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the world and the layout's groups) times out after `seconds`."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


# ---------------------------------------------------------------------------------------------
# Non-finite steps
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepVerdict:
    skip: bool                     # the step's loss or gradient norm was non-finite somewhere
    loss_ranks: tuple[int, ...]    # ranks whose loss was non-finite
    norm_ranks: tuple[int, ...]    # ranks whose gradient norm was non-finite
    stop_requested: bool           # some rank received SIGTERM


class NonFiniteGuard:
    """Judges each step on every rank alike and counts skips (see the module docstring)."""

    def __init__(self, reliability, *, rank: int, world: int, device: torch.device,
                 last_checkpoint=lambda: None):
        """Args:
            reliability: the `[mop.reliability]` section (on_nonfinite, max_consecutive_skips).
            last_checkpoint: () -> the folder of the run's newest resumable checkpoint, or None
                (named by the stop message).
        """
        self.last_checkpoint = last_checkpoint
        self.on_nonfinite = reliability.on_nonfinite
        self.max_consecutive = reliability.max_consecutive_skips
        self.rank, self.world, self.device = rank, world, device
        self.consecutive = 0

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, *, stop_requested: bool) -> StepVerdict:
        flags = torch.zeros(3, self.world, device=self.device)                  # [3, W]
        flags[0, self.rank] = (~torch.isfinite(loss.detach().float())).float()
        flags[1, self.rank] = (~torch.isfinite(grad_norm.detach().float().to(self.device))).float()
        flags[2, self.rank] = float(stop_requested)
        dist.all_reduce(flags)
        bad = flags.cpu() > 0
        loss_ranks = tuple(int(r) for r in bad[0].nonzero().flatten())
        norm_ranks = tuple(int(r) for r in bad[1].nonzero().flatten())
        return StepVerdict(bool(loss_ranks or norm_ranks), loss_ranks, norm_ranks, bool(bad[2].any()))

    def after(self, verdict: StepVerdict, *, step: int, named_params, grad_terms: dict | None = None) -> None:
        """Count a skip, or raise NonFiniteError (on every rank) when training must stop. Call
        before the gradients are dropped: the message names the first non-finite one."""
        if not verdict.skip:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.on_nonfinite == "skip" and self.consecutive < self.max_consecutive:
            return
        what = [f"loss on rank(s) {list(verdict.loss_ranks)}" if verdict.loss_ranks else "",
                f"gradient norm on rank(s) {list(verdict.norm_ranks)}" if verdict.norm_ranks else ""]
        why = ("mop.reliability.on_nonfinite = \"stop\"" if self.on_nonfinite == "stop" else
               f"{self.consecutive} non-finite steps in a row (mop.reliability.max_consecutive_skips = "
               f"{self.max_consecutive})")
        saved = self.last_checkpoint()
        advice = (f"The run's last checkpoint, {saved}, holds finite state: lower optimizer.lr or "
                  f"training.max_norm and resume from it" if saved else
                  "No checkpoint of this run has been saved (checkpoint.enable = false, or the run stopped "
                  "before its first checkpoint.interval): lower optimizer.lr or training.max_norm and start again")
        grad = first_nonfinite_grad(list(named_params), self.rank, self.world, self.device, grad_terms)
        raise NonFiniteError(f"non-finite {' and '.join(w for w in what if w)} at step {step}; {grad}; "
                             f"stopping after {why}. {advice}")


def first_nonfinite_grad(named_params: list, rank: int, world: int, device: torch.device,
                         grad_terms: dict | None = None) -> str:
    """'first non-finite gradient: NAME (rank r)', the first parameter in model order whose local
    gradient shard holds a NaN/inf on any rank (a collective: every rank calls it). `grad_terms`:
    {id(param): norm term} of gradients no longer on the device (streamed to the host), judged by
    their term (a non-finite gradient has a non-finite term)."""
    n, terms = len(named_params), grad_terms or {}

    def bad(p) -> bool:
        if id(p) in terms:
            return not bool(torch.isfinite(terms[id(p)]))
        return p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())
    first = next((i for i, (_, p) in enumerate(named_params) if bad(p)), n)
    index = torch.full((world,), n, dtype=torch.int64, device=device)   # [W]: each rank's first
    index[rank] = first
    dist.all_reduce(index, op=dist.ReduceOp.MIN)
    index = index.cpu()
    i = int(index.min())
    if i >= n:
        return "every gradient is finite (the loss alone was non-finite)"
    name = named_params[i][0].replace("._checkpoint_wrapped_module", "").replace("._fsdp_wrapped_module", "")
    return f"first non-finite gradient: {name} (rank {int((index == i).nonzero()[0])})"


def state_is_finite(tensors, device: torch.device) -> bool:
    """True when every floating tensor (DTensors by their local shard) is finite on every rank."""
    bad = torch.zeros((), device=device)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = local(t)
            if t.numel() and not bool(torch.isfinite(t).all()):
                bad.fill_(1.0)
                break
    dist.all_reduce(bad)
    return bool(bad.item() == 0)


def tensors_of(state) -> list:
    """Every tensor in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


# ---------------------------------------------------------------------------------------------
# Fault injection (tests): MOP_TRAIN_FAULT="nan_grad:STEPS:RANK:NAME" | "nan_loss:STEPS:RANK" |
# "hang:STEPS:RANK" (STEPS: comma-separated)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    kind: str          # "nan_loss" | "nan_grad" | "hang" (sleep before the step's collectives)
    steps: tuple       # the steps it fires at
    rank: int
    name: str = ""     # nan_grad: the first parameter whose name contains this

    @classmethod
    def from_env(cls, env=os.environ) -> "Fault | None":
        spec = env.get("MOP_TRAIN_FAULT", "")
        if not spec:
            return None
        kind, steps, rank, *name = spec.split(":")
        return cls(kind, tuple(int(s) for s in steps.split(",")), int(rank), name[0] if name else "")

    def fires(self, step: int, rank: int, kind: str) -> bool:
        return self.kind == kind and step in self.steps and rank == self.rank

    def hang(self, stop: "StopFlag") -> None:
        """Sleep past every collective timeout, until a signal (torchrun stopping the rank) arrives."""
        while not stop.requested:
            time.sleep(0.05)
        sys.exit(EXIT_STOPPED)

    def poison_grad(self, named_params) -> None:
        for name, p in named_params:
            if self.name in name and p.grad is not None:
                local(p.grad).view(-1)[0] = float("nan")
                return


# ---------------------------------------------------------------------------------------------
# Clean stop on SIGTERM, exit with the launcher
# ---------------------------------------------------------------------------------------------

class StopFlag:
    """Set by SIGTERM/SIGINT; the loop reads it at each step boundary (through NonFiniteGuard.check)."""

    def __init__(self):
        self.requested = False
        self.signal = None

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now
            sys.exit(EXIT_STOPPED)
        self.requested, self.signal = True, signal.Signals(signum).name


PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """Linux: have the kernel SIGKILL this rank when the process that launched it (torchrun's
    agent) dies, so no rank trains on, or writes checkpoints, after its launcher is gone."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return   # not under torchrun: the parent is a shell, which `nohup` users expect to outlive
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(EXIT_STOPPED)


# ---------------------------------------------------------------------------------------------
# One writer per dump folder
# ---------------------------------------------------------------------------------------------

class DumpFolderLock:
    """`{dump_folder}/.mop_train.lock`, created exclusively by rank 0, holding 'host pid'. A lock
    whose holder is on this host and no longer alive is stale: it is replaced (and said so)."""

    NAME = ".mop_train.lock"

    def __init__(self, dump_folder: str):
        self.path = os.path.join(dump_folder, self.NAME)
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock was replaced; raises DumpFolderLocked."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        note = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                host, pid = self.holder()
                if host == socket.gethostname() and not _alive(pid):
                    note = f"replaced a stale lock {self.path} (host {host}, pid {pid} is not running)"
                    os.unlink(self.path)
                    continue
                raise DumpFolderLocked(
                    f"dump folder {os.path.dirname(self.path)!r} is in use by another job (host {host}, pid "
                    f"{pid}; lock {self.path}); stop that job or use another --job.dump_folder. If that "
                    f"job is gone (another host crashed), delete {self.path}") from None
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            self.held = True
            return note
        raise DumpFolderLocked(f"could not take the lock {self.path}")

    def holder(self) -> tuple[str, int]:
        try:
            with open(self.path) as f:
                host, pid = f.read().split()
            return host, int(pid)
        except (OSError, ValueError):
            return "?", -1

    def release(self) -> None:
        if self.held and self.holder() == (socket.gethostname(), os.getpid()):
            os.unlink(self.path)
        self.held = False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_timeout(err: BaseException) -> bool:
    """Whether a backend error says a collective timed out (gloo: "Timed out waiting ...")."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


# ---------------------------------------------------------------------------------------------
# Debug: all-to-all split consistency
# ---------------------------------------------------------------------------------------------

class SplitMismatch(TrainingStop):
    exit_code = EXIT_HUNG   # on NCCL this exchange would hang; on gloo it returns garbage


def check_a2a_splits(send_splits, recv_splits, group, device: torch.device) -> None:
    """Raise SplitMismatch (on every rank of `group`) unless every rank's receive splits are the
    transpose of the send splits: rank r expects from rank s exactly what s sends to r."""
    P = dist.get_world_size(group)
    mine = torch.tensor([list(send_splits), list(recv_splits)], dtype=torch.int64, device=device)  # [2, P]
    parts = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts).cpu()                       # [P, 2, P]
    sends, recvs = table[:, 0], table[:, 1]                # sends[s, d]; recvs[r, s]
    bad = (recvs != sends.T).nonzero().tolist()
    if bad:
        shown = "; ".join(f"rank {r} expects {int(recvs[r, s])} rows from rank {s}, which sends "
                          f"{int(sends[s, r])}" for r, s in bad[:4])
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        raise SplitMismatch(f"all-to-all split mismatch in the group of global ranks {ranks}: {shown} "
                            f"(receive splits must be the transpose of the send splits)")


def install_a2a_split_check() -> None:
    """Debug mode ([mop.reliability] check_a2a_splits): every `dist.all_to_all_single` with explicit
    splits first checks them across its group (one all-gather of 2 x P counts each)."""
    original = dist.all_to_all_single
    if getattr(original, "checks_splits", False):
        return

    def checked(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if output_split_sizes is not None and input_split_sizes is not None:
            check_a2a_splits(input_split_sizes, output_split_sizes, group, input.device)
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    checked.checks_splits = True
    dist.all_to_all_single = checked
