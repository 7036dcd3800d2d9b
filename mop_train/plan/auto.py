"""`mop-train plan --auto`: choose a job's layout and operator settings from its world size and memories.

    planner = AutoPlanner(cfg, fixed=fixed_keys(overrides), world=64, ranks_per_node=8,
                          gpu_bytes=141 * GIB, host_bytes=2 * TIB, headroom=2 * GIB)
    result = planner.longest_context()          # or planner.fastest_at(seq_len); NothingFits otherwise
    print(format_result(planner, result))

The configurations and what each costs: mop_train.plan.search_space (SearchSpace, which AutoPlanner
extends with the searches below); the Result and its printout: mop_train.plan.auto_report.

  pruning            a family (E_p, P, dispatch, Ring-DTP and its schedule, checkpointing, tiling,
                     resharding) is dropped when its frugal knobs (every boundary on the host, the
                     optimizer state off the device) do not fit at the fewest tokens per rank the
                     search can give it; a structure is skipped when
                     its frugal knobs do not fit at S: no knob of it leaves less on the device.
  fastest_at(S)      structures by their fastest knobs' prediction (an upper bound on their tokens/s);
                     for each, the fastest knobs that fit, walking the knob grid in predicted order and
                     skipping what a failure rules out; stop when no structure left can enter the top 5.
  longest_context()  double S from the granule while some frugal structure fits, then bisect between
                     the last fit and the first miss among the structures that fitted at the last fit
                     (a plan grows with S, N and c); then fastest_at(S_max) picks the configuration.

Keys given on the command line (`fixed_keys`) are kept: only their given values are searched. What is
printed is re-planned with `plan_for_config` itself first.

Legend: W ranks, R ranks per node, D / E_p / P the degrees, B local batch, S context, N = B*S/D tokens
per rank, c token budget, K chunks.
"""

from __future__ import annotations

import math
import time

from mop_train.plan.auto_report import Result, format_result
from mop_train.plan.search_space import TIE_SHARE, SearchSpace
from mop_train.plan.settings import SEARCHED_KEYS, Evaluation, Settings, fixed_keys, keeps_no_less
from mop_train.plan.terms import GIB

__all__ = ["AutoPlanner", "NothingFits", "Result", "Settings", "fixed_keys", "format_result", "SEARCHED_KEYS"]

OBJECTIVES = ("context", "throughput")

KEEP = 5
"""Configurations that fit reported per search: the winner and four runners-up."""

class NothingFits(Exception):
    """No configuration fits; the message has the numbers and what would fix it."""


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

class AutoPlanner(SearchSpace):
    """The searches over the configurations of one job (SearchSpace's arguments): the fastest that fit at
    one context, the longest context, and what would make one fit when none does."""

    def __init__(self, base, *, fixed: set[str], world: int, ranks_per_node: int, gpu_bytes: int,
                 host_bytes: int, headroom: int = 0):
        super().__init__(base, fixed=fixed, world=world, ranks_per_node=ranks_per_node, gpu_bytes=gpu_bytes,
                         host_bytes=host_bytes, headroom=headroom)
        self._fail_at: dict[tuple, int] = {}   # context search: frugal key -> smallest S it did not fit
        self._fits_at: dict[int, list[tuple]] = {}
        self._tried: dict[int, list[Evaluation]] = {}

    # -- one structure's knobs --------------------------------------------------------------------

    def best_knobs(self, s: Settings) -> tuple[Evaluation | None, list[Evaluation]]:
        """The fastest knobs of structure `s` that fit, and the faster ones planned not to fit. Skips
        what a failure rules out: a device failure, any knobs with less SCO and an optimizer level that
        keeps no less on the device; a host failure, more SCO and a level that pins no less on the host
        (AdamW on the device pins none; among OffloadStreamAdamW's levels: settings.keeps_no_less)."""
        grid = self.knobs(s)
        levels = [row[0].level for row in grid]
        offloads = [row[0].offloads_optimizer for row in grid]
        order = sorted(((j, i) for j in range(len(grid)) for i in range(len(grid[j]))),
                       key=lambda ji: -self.predict(grid[ji[0]][ji[1]]).tokens_per_s)

        def ruled_out(j: int, i: int, fails: list, sign: int) -> bool:
            for fj, fi in fails:
                same_side = (j == fj) if not offloads[fj] else (
                    keeps_no_less(levels[j], levels[fj]) if sign > 0 else keeps_no_less(levels[fj], levels[j]))
                if sign * (i - fi) <= 0 and (same_side or (sign < 0 and not offloads[fj] and offloads[j])):
                    return True
            return False

        device_fails, host_fails, missed = [], [], []
        for j, i in order:
            if ruled_out(j, i, device_fails, 1) or ruled_out(j, i, host_fails, -1):
                continue
            e = self.evaluate(grid[j][i])
            if e.fits:
                return e, missed
            missed.append(e)
            (device_fails if not e.fits_device else host_fails).append((j, i))
        return None, missed

    # -- objectives -------------------------------------------------------------------------------

    def fastest_at(self, seq_len: int, keep: int = KEEP, *, explain: bool = True) -> Result:
        """The fastest configuration that fits at `seq_len` and the best of `keep - 1` other families
        (degrees, dispatch, Ring-DTP and its schedule, checkpointing, tiling, kept attention, FSDP2's
        resharding); NothingFits when none fits, saying what would fit (more searches: on more ranks, at a
        shorter context) unless `explain` is False."""
        start = time.perf_counter()
        structures = sorted(self.structures(seq_len),
                            key=lambda s: (-self.predict(self.knobs(s)[0][0]).tokens_per_s, s.label()))
        best: dict[tuple, Evaluation] = {}
        tried: list[Evaluation] = []
        for n, s in enumerate(structures):
            ranked = sorted(best.values(), key=lambda e: -e.tokens_per_s)
            bound = self.predict(self.knobs(s)[0][0]).tokens_per_s
            if (len(ranked) >= keep and bound < ranked[keep - 1].tokens_per_s
                    and bound < (1 - TIE_SHARE) * ranked[0].tokens_per_s):
                break      # nothing further down can enter the top `keep`, nor tie the best (_finish's tie-break)
            if self.dominated(s):                      # a twin (untiled, or with keep) fits and is faster
                continue
            frugal = self.frugal(s)
            if not frugal.fits_device:                 # no knob of this structure leaves less on the device
                if n < 3 or not best:                  # planned at its fastest knobs too, to say what it lacks
                    tried.append(self.evaluate(self.knobs(s)[0][0]))
                continue
            e, missed = self.best_knobs(s)
            tried += missed
            family = _family(s)
            if e is not None and (family not in best or e.tokens_per_s > best[family].tokens_per_s):
                best[family] = e
        ranked = sorted(best.values(), key=lambda e: -e.tokens_per_s)
        fits = [e for n, e in enumerate(ranked) if n < keep or e.tokens_per_s >= (1 - TIE_SHARE) * ranked[0].tokens_per_s]
        if not fits:
            if not explain:
                raise NothingFits(f"nothing fits at training.seq_len = {seq_len:,} on W={self.world} ranks")
            raise self.nothing_fits(seq_len, f"at training.seq_len = {seq_len:,}", context_hint=True)
        return self._finish("throughput", seq_len, fits, tried, start)

    def longest_context(self) -> Result:
        """The longest context (a multiple of the granule, at most the model's max_seq_len) that some
        configuration fits, and the fastest configurations there; NothingFits when not one granule fits.
        Doubles S while anything fits, then bisects between the last fit and the first miss, among the
        structures that fitted at the last fit (a structure's plan grows with S)."""
        start, g = time.perf_counter(), self.granule
        cap = self.model.args.max_seq_len // g * g
        if cap < g:
            raise NothingFits(f"model {self.base.model.flavor!r} takes at most max_seq_len = "
                              f"{self.model.args.max_seq_len:,} tokens, below the search's granule of {g:,}")
        ok, fail, S = None, None, g
        while True:
            if self._first_fit(S) is None:
                fail = S
                break
            ok = S
            if S >= cap:
                break
            S = min(2 * S, cap)
        if ok is None:
            raise self.nothing_fits(g, f"even at training.seq_len = {g:,} (the search's granule)")
        if fail is not None:
            survivors = self._all_fits(ok)
            while fail - ok > g and (mid := (ok + fail) // 2 // g * g) > ok:
                if self._first_fit(mid, among=survivors) is None:
                    fail = mid
                else:
                    ok = mid
        best = self.fastest_at(ok)
        misses = sorted((e for e in self._tried.get(fail, []) if not e.fits), key=lambda e: e.overshoot)[:3]
        for e in misses:
            best.disagreements += self.verify(e)
        best.objective, best.misses, best.seconds = "context", misses, time.perf_counter() - start
        best.stopped_by, best.next_seq_len = ("memory", fail) if fail is not None else ("max_seq_len", None)
        return best

    def _first_fit(self, seq_len: int, among: set[tuple] | None = None) -> Evaluation | None:
        """A configuration that fits at `seq_len`: the frugal structures not known to fail below it,
        those that fitted the longest context so far first."""
        tried = self._tried.setdefault(seq_len, [])
        done = [S for S in self._fits_at if S <= seq_len]
        first = set(self._fits_at[max(done)]) if done else set()
        for s in sorted(self.structures(seq_len, frugal_only=True), key=lambda s: _family(s) not in first):
            key = _family(s)
            if self._fail_at.get(key, math.inf) <= seq_len or (among is not None and key not in among):
                continue
            e = self._fit_any_knob(s)
            if e is not None:
                self._fits_at.setdefault(seq_len, []).append(key)
                return e
            tried.append(self.frugal(s))
        return None

    def _all_fits(self, seq_len: int) -> set[tuple]:
        """The frugal structures that fit at `seq_len`."""
        return {_family(s) for s in self.structures(seq_len, frugal_only=True) if self._fit_any_knob(s)}

    def _fit_any_knob(self, s: Settings) -> Evaluation | None:
        frugal = self.frugal(s)
        if not frugal.fits_device:                 # and not above this S either
            key = _family(s)
            self._fail_at[key] = min(s.seq_len, self._fail_at.get(key, math.inf))
            return None
        return frugal if frugal.fits else self.best_knobs(s)[0]   # host-bound: less SCO or offload

    def _finish(self, objective: str, seq_len: int, fits: list[Evaluation], tried: list[Evaluation],
                start: float) -> Result:
        """Re-plan what will be printed with `plan_for_config` itself; rank what fits by tokens/s."""
        notes: list[str] = []
        for e in fits:
            notes += self.verify(e)
        fitting = sorted((e for e in fits if e.fits), key=lambda e: -e.tokens_per_s)
        if not fitting:
            raise self.nothing_fits(seq_len, f"at training.seq_len = {seq_len:,} (after re-planning)")
        tied = [e for e in fitting if e.tokens_per_s >= (1 - TIE_SHARE) * fitting[0].tokens_per_s]
        chosen = min(tied, key=lambda e: (e.host, e.settings.operators_on, e.device, -e.tokens_per_s))
        fitting = [chosen] + [e for e in fitting if e is not chosen]
        faster = {e.settings: e for e in tried if e.plan is not None and e.tokens_per_s > chosen.tokens_per_s}
        misses = sorted(faster.values(), key=lambda e: -e.tokens_per_s)[:3]
        for e in misses:
            notes += self.verify(e)
        return Result(objective, seq_len, chosen, runners_up=fitting[1:], misses=[e for e in misses if not e.fits],
                      searched=len(self._predictions), planned=len(self._memo),
                      seconds=time.perf_counter() - start, disagreements=notes)

    # -- when nothing fits ------------------------------------------------------------------------

    def _memory_fix(self, e: Evaluation) -> str:
        """What that configuration needs: more GPU memory, more host memory, or both together."""
        gpu = f"--gpu-memory {math.ceil((e.device + self.headroom) / GIB)}GiB"
        host = f"--host-memory {math.ceil(e.host / GIB)}GiB"
        short_gpu, short_host = e.device > e.device_limit, e.host > e.host_limit
        if short_gpu and short_host:
            return f"that configuration with {gpu} and {host} per node together (it is short of both; neither alone)"
        return (f"that configuration with {gpu} alone (its host memory fits)" if short_gpu else
                f"that configuration with {host} per node alone (its GPU memory fits)")

    def nothing_fits(self, seq_len: int, where: str, *, context_hint: bool = False) -> NothingFits:
        """The error with the numbers: the closest configuration and what would make one fit."""
        planned = [e for e in self._memo.values() if e.settings.seq_len == seq_len and e.plan is not None] or [
            self.frugal(s, self.optimizers) for s in self.structures(seq_len, frugal_only=True, pruned=False)]
        planned = [e for e in planned if e.plan is not None]
        head = (f"nothing fits {where} on W={self.world} ranks ({self.ranks_per_node} per node), "
                f"{self.gpu_bytes / GIB:.1f} GiB per GPU ({self.headroom / GIB:.1f} GiB of it kept free) and "
                f"{self.host_bytes / GIB:.1f} GiB host per node")
        if not planned:
            refused = next((e.error for e in self._memo.values() if e.error), None)
            return NothingFits(f"{head}: " + (refused or "no layout of the searched degrees is valid for this model"))
        closest = min(planned, key=lambda e: e.overshoot)
        least_device = min(planned, key=lambda e: (e.device, e.overshoot))
        lines = [head + ".", f"closest ({len(self._memo)} configurations planned; measure: the larger of planned / "
                 f"usable for the GPU and for the host, smallest first): {_memories(closest)}", "would fit:",
                 f"  {self._memory_fix(closest)}"]
        if least_device is not closest and least_device.device < closest.device:
            lines.append(f"  the least GPU memory: {_memories(least_device)}; {self._memory_fix(least_device)}")
        for world in (2 * self.world, 4 * self.world, 8 * self.world):
            other = AutoPlanner(self.base, fixed=self.fixed, world=world, ranks_per_node=self.ranks_per_node,
                                gpu_bytes=self.gpu_bytes, host_bytes=self.host_bytes, headroom=self.headroom)
            e = other._first_fit(seq_len)
            if e is not None:
                lines.append(f"  on --world {world} ranks: {e.settings.label()} ({e.device / GIB:.1f} GiB per rank)")
                break
        else:
            lines.append(f"  not on up to {8 * self.world} ranks with these memories")
        if context_hint:
            try:
                lines.append(f"  at --training.seq_len {self.longest_context().seq_len} "
                             "(the longest context that fits on these ranks: --objective context)")
            except NothingFits:
                lines.append("  at no context on these ranks")
        return NothingFits("\n".join(lines))


def _memories(e: Evaluation) -> str:
    """A configuration and its two memories against what is usable (x: planned / usable)."""
    return (f"{e.settings.label()}: {e.device / GIB:.1f} GiB per rank ({e.device / e.device_limit:.2f}x the GPU's usable "
            f"{e.device_limit / GIB:.1f} GiB), {e.host / GIB:.1f} GiB host per node ({e.host / e.host_limit:.2f}x)")


def _family(s: Settings) -> tuple:
    """What the runners-up differ in: the degrees, the dispatch, Ring-DTP and its schedule, checkpointing,
    tiling, keep, FSDP2's resharding."""
    return (s.seq_degree, s.expert_degree, s.vocab_degree, s.dispatch, s.ring_dtp, s.ring_schedule, s.ac_mode,
            s.ffn_tokens, s.block_tokens, s.keep, s.reshard)

