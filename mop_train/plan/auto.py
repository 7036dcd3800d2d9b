"""`mop-train plan --auto`: choose a job's layout and operator settings from its world size and memories.

    planner = AutoPlanner(cfg, fixed=fixed_keys(overrides), world=64, ranks_per_node=8,
                          gpu_bytes=141 * GIB, host_bytes=2 * TIB, headroom=2 * GIB)
    result = planner.longest_context()          # or planner.fastest_at(seq_len); NothingFits otherwise
    print(format_result(planner, result))

A configuration (settings.Settings) is the degrees (D, E_p, P), the dispatch and PipelinedLLEP's
token budget c, Ring-DTP on or off, activation checkpointing (full or none) -- its *structure* -- and
two *knobs*: SCO's host budget (0 .. every checkpointed boundary, in quarters) and the optimizer
(AdamW on the device, or OffloadStreamAdamW keeping 3/4 .. none of its state on the device, with bf16
working weights at share 0 or weights and gradients streamed beside each share: settings.optimizer_levels). Memory
comes from the job's own plan (`plan_for_config`'s terms, with the meta model kept per flavor:
settings.fast_plan); speed from the ranking model of mop_train.plan.cost_model.

  pruning            a family (E_p, P, dispatch, Ring-DTP, checkpointing) is dropped when its frugal
                     knobs (every boundary on the host, the optimizer state off the device) do not fit
                     at the fewest tokens per rank the search can give it; a structure is skipped when
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
from dataclasses import dataclass, field, replace

from mop_train.layout import divisors, plan_layout
from mop_train.ops.moe_dispatch.pipelined_llep import num_chunks
from mop_train.ops.sco.budget import resolve_host_budget, retained_boundary_bytes
from mop_train.parallel.parallelize import check_layout_fits, checkpointed_layer_ids
from mop_train.parallel.precision import MixedPrecision
from mop_train.plan.cost_model import StepInputs, StepPrediction, format_prediction, predict_step
from mop_train.plan.job import plan_for_config
from mop_train.plan.report import plan_job
from mop_train.plan.settings import (SEARCHED_KEYS, Evaluation, Settings, configure, fast_plan, fixed_keys,
                                    flavor_model, keeps_no_less, optimizer_levels)
from mop_train.plan.terms import GIB
from mop_train.units import parse_device_fraction

__all__ = ["AutoPlanner", "NothingFits", "Result", "Settings", "fixed_keys", "format_result", "SEARCHED_KEYS"]

OBJECTIVES = ("context", "throughput")
SEQ_GRANULE = 1024
"""The context objective's resolution: S is a multiple of this (and of every searched D)."""

SCO_QUARTERS = (0, 1, 2, 3, 4)
"""SCO budgets tried: 0, 1/4 .. 4/4 of the checkpointed boundaries."""

KEEP = 5
"""Configurations that fit reported per search: the winner and four runners-up."""

TIE_SHARE = 0.01
"""Predicted tokens/s closer than this share are a tie (the cost model is good to about 12%): the tie goes to
the configuration that pins the least host memory, then runs the fewest operators, then plans the least."""


class NothingFits(Exception):
    """No configuration fits; the message has the numbers and what would fix it."""


@dataclass
class Result:
    objective: str
    seq_len: int
    chosen: Evaluation
    runners_up: list[Evaluation]
    """Fit, predicted slower than the chosen one, best first."""
    misses: list[Evaluation]
    """Better on the objective (faster, or a longer context) and planned not to fit, best first."""
    stopped_by: str = ""
    """Context objective: "memory" (S_max + one granule fits nothing) or "max_seq_len" (the model's)."""
    next_seq_len: int | None = None
    """Context objective: the smallest context tried that nothing fits."""
    searched: int = 0
    planned: int = 0
    seconds: float = 0.0
    disagreements: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

class AutoPlanner:
    """The configurations of one job on `world` ranks, with `gpu_bytes` per GPU (of which `headroom`
    stays unplanned) and `host_bytes` per node. `fixed`: the searched keys the user set, kept."""

    def __init__(self, base, *, fixed: set[str], world: int, ranks_per_node: int, gpu_bytes: int,
                 host_bytes: int, headroom: int = 0):

        if headroom >= gpu_bytes:
            raise ValueError(f"--headroom ({headroom / GIB:.1f} GiB) leaves nothing of --gpu-memory ({gpu_bytes / GIB:.1f} "
                             "GiB) to plan; give a smaller --headroom (0 plans the whole GPU)")
        self.base, self.fixed, self.world, self.ranks_per_node = base, set(fixed), world, ranks_per_node
        self.gpu_bytes, self.host_bytes, self.headroom = gpu_bytes, host_bytes, headroom
        self.model = flavor_model(base.model.flavor)
        a, lay, t = self.model.args, base.mop.layout, base.training
        given = [getattr(lay, k) if f"mop.layout.{k}" in self.fixed else 1
                 for k in ("seq_degree", "expert_degree", "vocab_degree")]
        check_layout_fits(plan_layout(world, *given), replace(t, seq_len=given[0]), a)   # the user's degrees, or the error

        def options(key: str, current, values) -> list:
            return [current] if key in self.fixed else list(values)

        def heads_split(D: int) -> bool:                  # the layout check of plan_for_config, at S = D
            try:
                check_layout_fits(plan_layout(world, D, 1, 1), replace(t, seq_len=D), a)
            except ValueError:
                return False
            return True

        self.seq_degrees = [d for d in options("mop.layout.seq_degree", lay.seq_degree, divisors(world))
                            if world % d == 0 and heads_split(d)]
        self.expert_degrees = [e for e in options("mop.layout.expert_degree", lay.expert_degree,
                                                  divisors(world) if a.n_moe_layers else [1])
                               if world % e == 0 and a.num_experts % e == 0]
        self.vocab_degrees = [p for p in options("mop.layout.vocab_degree", lay.vocab_degree, divisors(world))
                              if world % p == 0]
        self.ac_modes = options("activation_checkpoint.mode", base.activation_checkpoint.mode, ("full", "none"))
        self.optimizers = optimizer_levels(self.base, self.fixed)
        self.granule = math.lcm(SEQ_GRANULE, *self.seq_degrees)
        self._memo: dict[Settings, Evaluation] = {}
        self._grids: dict[tuple, list[list[Settings]]] = {}
        self._predictions: dict[Settings, StepPrediction] = {}
        self._family_floor: dict[tuple, list] = {}    # family -> optimizer levels that can fit it
        self._fail_at: dict[tuple, int] = {}   # context search: frugal key -> smallest S it did not fit
        self._fits_at: dict[int, list[tuple]] = {}
        self._tried: dict[int, list[Evaluation]] = {}

    # -- candidates -------------------------------------------------------------------------------

    def structures(self, seq_len: int, *, frugal_only: bool = False, pruned: bool = True) -> list[Settings]:
        """Every structure valid at `seq_len` whose family may fit (all of them with `pruned=False`),
        knobs at placeholders. With `frugal_only`, PipelinedLLEP takes only its smallest token budget
        (its plan grows with c)."""
        base, out = self.base, []
        for D in self.seq_degrees:
            if seq_len % D:
                continue
            tokens = base.training.local_batch_size * seq_len // D
            for Ep in self.expert_degrees:
                for dispatch in self._dispatches(Ep):
                    budgets = self._token_budgets(dispatch, tokens)
                    for c in budgets[:1] if frugal_only else budgets:
                        for P in self.vocab_degrees:
                            for ring in self._rings(P):
                                for ac in self.ac_modes:
                                    s = Settings(seq_len, D, Ep, P, dispatch, c, ring, ac)
                                    if not pruned or self._viable_levels(s):
                                        out.append(s)
        return out

    def _dispatches(self, Ep: int) -> list[str]:
        if "mop.moe.dispatch" in self.fixed:
            d = self.base.mop.moe.dispatch
            return [] if d == "local" and Ep > 1 else [d]
        return ["local", "pipelined_llep"] if Ep == 1 else ["ep", "llep", "pipelined_llep"]

    def _rings(self, P: int) -> list[bool]:
        if "mop.ring_dtp.enable" in self.fixed:
            return [self.base.mop.ring_dtp.enable]
        return [True] if P > 1 else [False, True]       # P > 1 is Ring-DTP whatever the flag says

    def _token_budgets(self, dispatch: str, tokens: int) -> list[int]:
        """PipelinedLLEP's c, smallest first: powers of two from ceil(N / K_max) up, one per chunk count K."""
        if dispatch != "pipelined_llep" or "mop.moe.token_budget" in self.fixed:
            return [self.base.mop.moe.token_budget]
        k_max, seen, out = self.base.mop.moe.max_chunks, set(), []
        c = 1 << math.ceil(math.log2(max(1, math.ceil(tokens / k_max))))
        while True:
            K = num_chunks(max(tokens, 1), c, k_max)[0]
            if K not in seen:
                seen.add(K)
                out.append(c)
            if K == 1:
                return out
            c *= 2

    def knobs(self, s: Settings, levels: list[tuple[str, str]] | None = None) -> list[list[Settings]]:
        """grid[j][i]: optimizer level j (fastest first; those that can fit its family), SCO budget i (none
        first). Along either axis the step gets slower; along i the device plan shrinks and the host plan
        grows, and so along j among OffloadStreamAdamW's levels."""
        levels = self._viable_levels(s) if levels is None else levels
        levels = [level for level in levels if self._level_runs(s, level)]
        key = (s, tuple(levels))
        if key not in self._grids:
            self._grids[key] = self._grid(s, levels)
        return self._grids[key]

    def _grid(self, s: Settings, levels: list[tuple[str, str]]) -> list[list[Settings]]:
        if "mop.sco.host_budget" in self.fixed:
            budgets = [self.base.mop.sco.host_budget]
        elif s.ac_mode == "none":
            budgets = ["0"]
        else:
            boundary, layers = self._boundary_bytes(s), self._checkpointed(s)
            budgets = [_byte_text(n * boundary) for n in sorted({math.ceil(q * layers / 4) for q in SCO_QUARTERS})]
        return [[replace(s, sco_budget=b, optimizer=o, device_fraction=f, weights=w, gradients=g) for b in budgets]
                for o, f, w, g in levels]

    @staticmethod
    def _level_runs(s: Settings, level) -> bool:
        """weights = "stream" reuses an expert block's slot after its forward: every block checkpointed."""
        return level[2] != "stream" or s.dispatch == "local" or s.ac_mode == "full"

    def frugal(self, s: Settings, levels: list[tuple[str, str]] | None = None) -> Evaluation:
        """The knobs that leave the least on the device: every boundary SCO may hold and either the
        whole optimizer state streamed or AdamW on the device (whose moments are smaller than
        OffloadStreamAdamW's staging for a small model), whichever plans less."""
        grid = self.knobs(s, levels)
        e = self.evaluate(grid[-1][-1])
        if e.fits_device or len(grid) == 1 or grid[0][0].offloads_optimizer:
            return e
        other = self.evaluate(grid[0][-1])
        return other if other.plan is not None and (e.plan is None or other.device < e.device) else e

    def _viable_levels(self, s: Settings) -> list[tuple[str, str]]:
        """The optimizer levels that can fit s's family (E_p, P, dispatch, Ring-DTP, checkpointing): those
        that fit the device at the search's fewest tokens per rank (S = lcm of the D, the largest D), the
        smallest c and every boundary on the host. A plan only grows from there (with S, N and c), so a
        level that does not fit there never does; a family with no level left is not searched."""
        key = (s.expert_degree, s.vocab_degree, s.dispatch, s.ring_dtp, s.ac_mode)
        if key not in self._family_floor:
            D, S = max(self.seq_degrees), math.lcm(*self.seq_degrees)
            c = self._token_budgets(s.dispatch, self.base.training.local_batch_size * S // D)[0]
            floor = replace(s, seq_len=S, seq_degree=D, token_budget=c)
            frugal = self.frugal(floor, self.optimizers)
            if frugal.plan is None:                    # the job refuses the floor (its batch, say): no pruning
                self._family_floor[key] = self.optimizers
            elif not frugal.fits_device:
                self._family_floor[key] = []
            else:
                grid = self.knobs(floor, self.optimizers)
                runs = [level for level in self.optimizers if self._level_runs(floor, level)]
                self._family_floor[key] = [level for level, row in zip(runs, grid)
                                           if self.evaluate(row[-1]).fits_device]
        return self._family_floor[key]

    def _boundary_bytes(self, s: Settings) -> int:
        act = MixedPrecision.from_training(self.base.training).activation_bytes
        return self.base.training.local_batch_size * s.seq_len // s.seq_degree * self.model.args.dim * act

    def _checkpointed(self, s: Settings) -> int:
        ac = replace(self.base.activation_checkpoint, mode=s.ac_mode)
        return len(checkpointed_layer_ids(ac, self.model.args.n_layers))

    # -- one configuration ------------------------------------------------------------------------

    def predict(self, s: Settings) -> StepPrediction:
        if s not in self._predictions:
            self._predictions[s] = predict_step(self._step_inputs(s))
        return self._predictions[s]

    def _step_inputs(self, s: Settings) -> StepInputs:
        m, t, W = self.model, self.base.training, self.world
        layout = plan_layout(W, s.seq_degree, s.expert_degree, s.vocab_degree)
        boundary, layers = self._boundary_bytes(s), self._checkpointed(s)
        budget = 0 if s.sco_budget.strip() == "0" else resolve_host_budget(
            s.sco_budget, self.ranks_per_node, available_bytes=self.host_bytes)
        one_step = t.local_batch_size * W // s.seq_degree
        share = parse_device_fraction(s.device_fraction)
        experts, vocab = m.shard_params(layout, s.dispatch)
        return StepInputs(
            model=m.args, active_params=m.active, embedding_params=m.embedding,
            fsdp_params=m.fsdp_params(layout, s.dispatch), local_params=m.local_params(layout, s.dispatch),
            expert_shard_params=experts, vocab_shard_params=vocab, world=W, ranks_per_node=self.ranks_per_node,
            seq_len=s.seq_len, local_batch=t.local_batch_size,
            micro_batches=max(1, t.global_batch_size // one_step) if t.global_batch_size != -1 else 1,
            seq_degree=s.seq_degree, expert_degree=s.expert_degree, vocab_degree=s.vocab_degree,
            dispatch=s.dispatch, token_budget=s.token_budget, max_chunks=self.base.mop.moe.max_chunks,
            ring_dtp=s.ring_dtp, checkpointed_layers=layers,
            sco_offloaded_bytes=layers * boundary - retained_boundary_bytes([boundary] * layers, budget),
            offload_optimizer=s.offloads_optimizer, device_fraction=0.0 if share == "auto" else share,
            stream_weights=s.offloads_optimizer and s.weights == "stream",
            stream_gradients=s.offloads_optimizer and s.gradients == "stream",
            act_bytes=MixedPrecision.from_training(t).activation_bytes)

    def evaluate(self, s: Settings) -> Evaluation:
        if s not in self._memo:
            e = Evaluation(s, self.predict(s), device_limit=self.gpu_bytes - self.headroom,
                           host_limit=self.host_bytes)
            try:
                e.plan = fast_plan(configure(self.base, s), world=self.world, ranks_per_node=self.ranks_per_node,
                                   host_bytes=self.host_bytes)
            except ValueError as err:
                e.error = str(err)
            self._memo[s] = e
        return self._memo[s]

    def verify(self, e: Evaluation) -> list[str]:
        """Re-plan `e` with `plan_for_config` itself; the differences from `fast_plan`, if any."""
        if e.verified or e.plan is None:
            return []
        fast, e.verified = e.plan, True
        e.plan = plan_for_config(configure(self.base, e.settings), world=self.world,
                                 ranks_per_node=self.ranks_per_node, host_bytes=self.host_bytes)
        if (fast.device_bytes, fast.host_bytes_per_node) == (e.device, e.host):
            return []
        return [f"{e.settings.label()} at S={e.settings.seq_len:,}: cached plan {fast.device_bytes / GIB:.3f} / "
                f"{fast.host_bytes_per_node / GIB:.3f} GiB, plan_for_config {e.device / GIB:.3f} / {e.host / GIB:.3f}"]

    def best_knobs(self, s: Settings) -> tuple[Evaluation | None, list[Evaluation]]:
        """The fastest knobs of structure `s` that fit, and the faster ones planned not to fit. Skips
        what a failure rules out: a device failure, any knobs with less SCO and an optimizer level that
        keeps no less on the device; a host failure, more SCO and a level that pins no less on the host
        (AdamW on the device pins none; among OffloadStreamAdamW's levels: settings.keeps_no_less)."""
        grid = self.knobs(s)
        levels = [(r[0].optimizer, r[0].device_fraction, r[0].weights, r[0].gradients) for r in grid]
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
        (degrees, dispatch, Ring-DTP, checkpointing); NothingFits when none fits, saying what would fit
        (more searches: on more ranks, at a shorter context) unless `explain` is False."""
        start = time.perf_counter()
        structures = sorted(self.structures(seq_len),
                            key=lambda s: (-self.predict(self.knobs(s)[0][0]).tokens_per_s, s.label()))
        best: dict[tuple, Evaluation] = {}
        tried: list[Evaluation] = []
        for n, s in enumerate(structures):
            ranked = sorted(best.values(), key=lambda e: -e.tokens_per_s)
            if len(ranked) >= keep and self.predict(self.knobs(s)[0][0]).tokens_per_s < ranked[keep - 1].tokens_per_s:
                break                                  # nothing further down can enter the top `keep`
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
        fits = sorted(best.values(), key=lambda e: -e.tokens_per_s)[:keep]
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
    """What the runners-up differ in: the degrees, the dispatch, Ring-DTP, checkpointing."""
    return (s.seq_degree, s.expert_degree, s.vocab_degree, s.dispatch, s.ring_dtp, s.ac_mode)


def _byte_text(n: int) -> str:
    """A byte count as [mop.sco] host_budget takes it: whole GiB or MiB where exact, else bytes."""
    if n == 0:
        return "0"
    if n % GIB == 0:
        return f"{n // GIB}GiB"
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else str(n)


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def _table(rows: list[Evaluation], *, with_context: bool = False) -> list[str]:
    lines = [f"  {'tokens/s':>10}  {'step s':>8}  {'peak GiB':>8}  {'host GiB/node':>13}  "
             + ("context    " if with_context else "") + "configuration"]
    for e in rows:
        lines.append(f"  {e.tokens_per_s:>10,.0f}  {e.prediction.seconds:>8.3f}  {e.device / GIB:>8.1f}  "
                     f"{e.host / GIB:>13.1f}  " + (f"{e.settings.seq_len:<10,} " if with_context else "")
                     + e.settings.label())
    return lines


def format_result(planner: AutoPlanner, r: Result) -> str:
    """The chosen overrides (flags and TOML), the predicted peak and step, the chosen plan term by
    term, the runners-up and what would have been better but does not fit."""
    p, e, base = planner, r.chosen, planner.base
    lines = [f"mop-train plan --auto: objective {r.objective} on W={p.world} ranks ({p.ranks_per_node} per node), "
             f"{p.gpu_bytes / GIB:.1f} GiB per GPU ({p.headroom / GIB:.1f} GiB of it kept free), "
             f"{p.host_bytes / GIB:.1f} GiB host per node",
             f"searched {r.searched:,} configurations, planned {r.planned:,}, in {r.seconds:.2f} s"
             + (f"; kept as given: {', '.join(sorted(p.fixed))}" if p.fixed else "")]
    if r.objective == "context":
        lines.append(f"longest context that fits: {r.seq_len:,} tokens (" + (
            f"{r.next_seq_len:,} fits no configuration)" if r.stopped_by == "memory"
            else "the model's max_seq_len; memory was not the limit)"))
    else:
        lines.append(f"fastest configuration that fits at training.seq_len = {r.seq_len:,}")
    lines += ["", "chosen overrides:", "  " + " ".join(e.settings.flags(base)), "", "as TOML:"]
    lines += ["  " + line for line in e.settings.toml(base).splitlines()]
    lines += ["", f"predicted peak per rank {e.device / GIB:.1f} GiB of {p.gpu_bytes / GIB:.1f} GiB; pinned host "
              f"{e.host / GIB:.1f} GiB of {p.host_bytes / GIB:.1f} GiB per node",
              format_prediction(e.prediction), "",
              plan_job(configure(base, e.settings), world=p.world, ranks_per_node=p.ranks_per_node,
                       gpu_bytes=p.gpu_bytes, host_bytes=p.host_bytes)[0]]
    if r.runners_up:
        lines += ["", "runners-up (fit; predicted slower; the best of each other layout/dispatch/checkpointing):"]
        lines += _table(r.runners_up)
    if r.misses:
        lines += ["", "better on the objective but planned not to fit:"]
        lines += _table(r.misses, with_context=r.objective == "context")
    if r.disagreements:
        lines += ["", "note: the cached planner differed from plan_for_config (these were re-planned with it):"]
        lines += ["  " + d for d in r.disagreements]
    return "\n".join(lines)
