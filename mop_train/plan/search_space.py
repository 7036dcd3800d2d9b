"""The configurations one `mop-train plan --auto` job may take, and each one's predicted step and plan.

SearchSpace enumerates them and memoizes what each costs; the searches over them (the objectives, what
would fit when nothing does) are mop_train.plan.auto's AutoPlanner, which extends it.

A configuration (settings.Settings) is the degrees (D, E_p, P), the dispatch and PipelinedLLEP's
token budget c, Ring-DTP on or off and, at P = 1, its schedule (recompute or grad_in_forward), activation
checkpointing (full or none), sequence tiling (off, or both `[mop.tiling]` sizes "auto"), under full
checkpointing `[mop.attention] keep`, and FSDP2's `fsdp_reshard_after_forward` ("default" or "never", which
holds every block unsharded through the loss; never beside streamed weights) -- its *structure* -- and
two *knobs*: SCO's host budget (0 .. every checkpointed boundary, in quarters) and the optimizer
(AdamW on the device, or OffloadStreamAdamW keeping 3/4 .. none of its state on the device, with bf16
working weights at share 0 or weights and gradients streamed beside each share, and the CPU updating 0.3 ..
0.7 of the streamed rest where that pays beyond a tie: settings.optimizer_levels). Memory
comes from the job's own plan (`plan_for_config`'s terms, with the meta model kept per flavor:
settings.fast_plan); speed from the ranking model of mop_train.plan.cost_model.

  pruning            a family (E_p, P, dispatch, Ring-DTP and its schedule, checkpointing, tiling,
                     resharding) is dropped when its frugal knobs (every boundary on the host, the
                     optimizer state off the device) do not fit at the fewest tokens per rank the
                     search can give it.

Keys given on the command line (`fixed_keys`) are kept: only their given values are searched.

Legend: W ranks, R ranks per node, D / E_p / P the degrees, B local batch, S context, N = B*S/D tokens
per rank, c token budget, K chunks.
"""

from __future__ import annotations

import math
from dataclasses import replace

from mop_train.layout import divisors, plan_layout
from mop_train.ops.moe_dispatch.pipelined_llep import num_chunks
from mop_train.ops.offload_adamw import OFFLOAD_ADAMW
from mop_train.ops.sco.budget import resolve_host_budget, retained_boundary_bytes
from mop_train.parallel.parallelize import check_layout_fits, checkpointed_layer_ids
from mop_train.parallel.precision import MixedPrecision
from mop_train.plan.cost_model import StepInputs, StepPrediction, offload_step_seconds, predict_step
from mop_train.plan.job import operator_plan, plan_for_config, ring_dtp_plan_schedule
from mop_train.plan.settings import (Evaluation, Level, Settings, configure, fast_plan, flavor_model,
                                     optimizer_levels)
from mop_train.plan.terms import GIB, loss_bound
from mop_train.units import parse_device_fraction

SEQ_GRANULE = 1024
"""The context objective's resolution: S is a multiple of this (and of every searched D)."""

SCO_QUARTERS = (0, 1, 2, 3, 4)
"""SCO budgets tried: 0, 1/4 .. 4/4 of the checkpointed boundaries."""

TIE_SHARE = 0.01
"""Predicted tokens/s closer than this share are a tie (the cost model is good to about 12%): the tie goes to
the configuration that pins the least host memory, then runs the fewest operators, then plans the least
(AutoPlanner._finish). The search leaves out what could only win a tie it would lose."""


class SearchSpace:
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
        tiling = base.mop.tiling
        ffn = options("mop.tiling.ffn_tokens", tiling.ffn_tokens, (0, "auto"))
        block = options("mop.tiling.block_tokens", tiling.block_tokens, (0, "auto"))
        # neither given: untiled or both "auto" (the FFN alone tiled is never the smaller plan at equal speed)
        self.tilings = [(0, 0), ("auto", "auto")] if len(ffn) == len(block) == 2 else [(f, b) for f in ffn for b in block]
        self.keeps = options("mop.attention.keep", base.mop.attention.keep, (False, True))
        # "default" first: "never" only adds to a plan (every block unsharded through the loss)
        self.reshards = options("parallelism.fsdp_reshard_after_forward", base.parallelism.fsdp_reshard_after_forward,
                                ("default", "never"))
        self.granule = math.lcm(SEQ_GRANULE, *self.seq_degrees)
        self._memo: dict[Settings, Evaluation] = {}
        self._grids: dict[tuple, list[list[Settings]]] = {}
        self._predictions: dict[Settings, StepPrediction] = {}
        self._family_floor: dict[tuple, list] = {}    # family -> optimizer levels that can fit it
        self._cache: dict[tuple, object] = {}          # loss bytes, layouts, checkpointed blocks, optimizer terms
        levels = optimizer_levels(self.base, self.fixed)
        self.optimizers = [level for level in levels if self._share_can_pay(level, levels)]

    # -- candidates -------------------------------------------------------------------------------

    def structures(self, seq_len: int, *, frugal_only: bool = False, pruned: bool = True) -> list[Settings]:
        """Every structure valid at `seq_len` whose family may fit (all of them with `pruned=False`),
        knobs at placeholders. With `frugal_only`, PipelinedLLEP takes only its smallest token budget
        (its plan grows with c) and FSDP2 only its first resharding policy (under "never" a plan only grows)."""
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
                                for sched in self._ring_schedules(P, ring):
                                    for ac in self.ac_modes:
                                        s = Settings(seq_len, D, Ep, P, dispatch, c, ring, ac, ring_schedule=sched)
                                        out += self._variants(s, frugal_only=frugal_only, pruned=pruned)
        return out

    def _variants(self, s: Settings, *, frugal_only: bool, pruned: bool) -> list[Settings]:
        """s with each searched tiling, keep and resharding policy (structures' flags); keep only where blocks
        are checkpointed (what it keeps is what their recompute would replay). A given keep is paired with
        another checkpointing mode only when that mode is given too: keep does nothing there, and the plan's
        block term (plan/block.py) takes the kept bytes out of every block while terms.py adds them back only
        for checkpointed ones. A searched "never" follows its "default" twin where that may fit and "never"
        pays (`_never_pays`): its plan only grows, and its floor is its own."""
        if s.ac_mode == "full":
            keeps = self.keeps
        elif "mop.attention.keep" not in self.fixed:
            keeps = [False]
        else:
            keeps = self.keeps if "activation_checkpoint.mode" in self.fixed or not self.keeps[0] else []
        pair = self.reshards == ["default", "never"]
        reshards = self.reshards[:1] if frugal_only or pair else self.reshards
        out = []
        for v in [replace(s, ffn_tokens=f, block_tokens=b, keep=k, reshard=r)
                  for r in reshards for k in keeps for f, b in self.tilings]:
            if pruned and not (self._grad_in_forward_pays(v) and self._viable_levels(v)):
                continue
            out.append(v)
            if pair and not frugal_only and self._never_pays(v):
                never = replace(v, reshard="never")
                out += [never] if not pruned or self._viable_levels(never) else []
        return out

    def _grad_in_forward_pays(self, s: Settings) -> bool:
        """Whether a searched grad_in_forward s (P = 1) can be chosen over its twin with the chunked loss
        (Ring-DTP off, where that is searched): by a predicted saving of at least TIE_SHARE of the twin's
        step at its fastest knobs (the saving is the same at any knobs), or by a smaller loss working set,
        which may fit where the chunked loss does not. Otherwise the twin plans no more, runs two settings
        fewer and wins or ties."""
        if (not s.ring_dtp or s.vocab_degree > 1 or s.ring_schedule != "grad_in_forward"
                or "mop.ring_dtp.schedule" in self.fixed or False not in self._rings(1)):
            return True
        chunked = replace(s, ring_dtp=False, ring_schedule="recompute")
        if self._loss_bytes(s) < self._loss_bytes(chunked):
            return True
        grid = self.knobs(chunked) if self._viable_levels(chunked) else []
        if not grid:
            return True
        step = self.predict(grid[0][0]).seconds
        ring = replace(grid[0][0], ring_dtp=True, ring_schedule="grad_in_forward")
        return step - self.predict(ring).seconds >= TIE_SHARE * step

    def _loss_bytes(self, s: Settings) -> int:
        """The loss's working set in s's plan (terms.loss_bound of the job's operator plan)."""
        key = ("loss", s.seq_len // s.seq_degree, s.vocab_degree, s.runs_ring_dtp and s.ring_schedule)
        if key not in self._cache:
            cfg, act = configure(self.base, s), MixedPrecision.from_training(self.base.training).activation_bytes
            layout = self._layout(s)
            ops = operator_plan(cfg, self.model.args, layout_plan=layout, act_bytes=act, sco_host_budget=0,
                                device_fraction=0.0)
            tokens = self.base.training.local_batch_size * s.seq_len // s.seq_degree
            self._cache[key] = loss_bound(ops, self.model.args, tokens=tokens, vocab_degree=s.vocab_degree,
                                          act_bytes=act).device_bytes
        return self._cache[key]

    def _never_pays(self, s: Settings) -> bool:
        """Whether s's "never" twin can be chosen over s (reshard "default"): it plans no less (with at
        least two blocks: the plan's default holds two), so it can win only by a predicted saving of at
        least TIE_SHARE of s's step at its fastest knobs (the structure's placeholders: slower knobs add
        the same seconds to both; "never" has no faster ones); below that the tie goes to s, which runs
        fewer settings."""
        block, blocks, _, _ = self.model.gathered_units(self._layout(s), s.dispatch)
        if blocks < 2 * block:
            return True
        grid = self.knobs(s)
        fastest = grid[0][0] if grid else s      # (the saving is the same at any knobs)
        step = self.predict(fastest).seconds
        return step - self.predict(replace(fastest, reshard="never")).seconds >= TIE_SHARE * step

    def dominated(self, s: Settings) -> bool:
        """Whether a twin of structure s fits at its fastest knobs and is predicted no slower than s at its own:
        the untiled twin of a tiled s (tiling never plans more and costs cost_model's TILING_SHARE), the
        kept twin of an s without keep (keep plans more but skips the recompute's attention), the
        grad_in_forward twin of Ring-DTP's recompute schedule or the "never" twin of FSDP2's default
        resharding (both predicted faster). s cannot then be the fastest that fits; the search skips it. A
        twin that runs one setting more than s must be faster by more than TIE_SHARE: within it, s would
        win the tie."""
        twins = []   # (twin, the share of its speed s must stay under)
        if s.tiled and (0, 0) in self.tilings:
            twins.append((replace(s, ffn_tokens=0, block_tokens=0), 1.0))
        if not s.keep and s.ac_mode == "full" and True in self.keeps:
            twins.append((replace(s, keep=True), 1.0 - TIE_SHARE))
        if s.ring_schedule == "recompute" and "grad_in_forward" in self._ring_schedules(s.vocab_degree, s.ring_dtp):
            twins.append((replace(s, ring_schedule="grad_in_forward"), 1.0 - TIE_SHARE))
        if s.reshard == "default" and self.reshards == ["default", "never"] and self._never_pays(s):
            twins.append((replace(s, reshard="never"), 1.0 - TIE_SHARE))
        for twin, share in twins:
            if self._viable_levels(twin):
                fastest = self.knobs(twin)[0][0]
                if self.evaluate(fastest).fits and share * self.predict(fastest).tokens_per_s >= self.predict(
                        self.knobs(s)[0][0]).tokens_per_s:
                    return True
        return False

    def _dispatches(self, Ep: int) -> list[str]:
        if "mop.moe.dispatch" in self.fixed:
            d = self.base.mop.moe.dispatch
            return [] if d == "local" and Ep > 1 else [d]
        return ["local", "pipelined_llep"] if Ep == 1 else ["ep", "llep", "pipelined_llep"]

    def _rings(self, P: int) -> list[bool]:
        if "mop.ring_dtp.enable" in self.fixed:
            return [self.base.mop.ring_dtp.enable]
        return [True] if P > 1 else [False, True]       # P > 1 is Ring-DTP whatever the flag says

    def _ring_schedules(self, P: int, ring: bool) -> list[str]:
        """Ring-DTP's schedules where it runs: a given one, else recompute and, at P = 1 (the one point
        measured; at P > 1 its rounds' all-reduces and dX ring are not), grad_in_forward, which moves
        activations (so not beside a given mode = "move_weights")."""
        rd = self.base.mop.ring_dtp
        if not (ring or P > 1):
            return ["recompute"]                       # (unused: the chunked loss runs)
        if "mop.ring_dtp.schedule" in self.fixed:
            return [rd.schedule]
        return ["recompute", "grad_in_forward"] if P == 1 and rd.mode != "move_weights" else ["recompute"]

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

    def knobs(self, s: Settings, levels: list[Level] | None = None) -> list[list[Settings]]:
        """grid[j][i]: optimizer level j (fastest first; those that can fit its family and, unless `levels`
        are given, only the CPU shares that pay: `_cpu_shares`), SCO budget i (none first). Along i the step
        gets slower, the device plan shrinks and the host plan grows; so along j among OffloadStreamAdamW's
        levels, but for a CPU share, faster than its twin without one and just before it."""
        search = levels is None
        levels = self._viable_levels(s) if levels is None else levels
        levels = [level for level in levels if self._level_runs(s, level)]
        if search:
            levels = self._cpu_shares(s, levels)
        key = (s, tuple(levels))
        if key not in self._grids:
            self._grids[key] = self._grid(s, levels)
        return self._grids[key]

    def _share_can_pay(self, level: Level, levels: list[Level]) -> bool:
        """Whether a searched CPU share can make OffloadStreamAdamW's step faster than its twin without one
        (a given host_fraction has no twin: kept). The step is linear in the parameters (cost_model), so
        one count decides it for every layout; where it does not pay (ranks sharing a host, say) it is
        left out of the whole search."""
        twin = level._replace(host_fraction=0.0)
        return not level.host_fraction or twin not in levels or (
            self._offload_seconds(10**9, level) < self._offload_seconds(10**9, twin))

    def _offload_seconds(self, local: int, level: Level) -> float:
        """cost_model's optimizer term for `local` parameters per rank at OffloadStreamAdamW's `level`: all of
        the step a CPU share changes."""
        key = ("offload", local, level)
        if key not in self._cache:
            share = parse_device_fraction(level.device_fraction)
            self._cache[key] = offload_step_seconds(
                local, device_fraction=0.0 if share == "auto" else share, host_fraction=level.host_fraction,
                stream_weights=level.weights == "stream", stream_gradients=level.gradients == "stream",
                sharing=min(self.ranks_per_node, self.world),
                act_bytes=MixedPrecision.from_training(self.base.training).activation_bytes)[0]
        return self._cache[key]

    def _cpu_shares(self, s: Settings, levels: list[Level]) -> list[Level]:
        """`levels` with each searched CPU share that can be chosen over its twin without one at structure s:
        by a predicted saving of at least TIE_SHARE of the twin's step (the same at any SCO budget); below
        that the twin, one setting fewer and planning no more, wins or ties. Beside streamed gradients every
        share plans the same, so only a twin's fastest is kept. The fastest level goes first."""
        local = self.model.local_params(self._layout(s), s.dispatch)

        def twin(level: Level) -> Level:
            return level._replace(host_fraction=0.0)

        def saving(level: Level) -> float:
            return self._offload_seconds(local, twin(level)) - self._offload_seconds(local, level)

        steps: dict[Level, float] = {}

        def step(level: Level) -> float:
            if level not in steps:
                steps[level] = self.predict(_at(s, level)).seconds
            return steps[level]

        kept = [level for level in levels if not level.host_fraction or twin(level) not in levels
                or (saving(level) > 0 and saving(level) >= TIE_SHARE * step(twin(level)))]
        fastest: dict[Level, Level] = {}
        for level in kept:
            if level.host_fraction and level.gradients == "stream":
                if twin(level) not in fastest or saving(level) > saving(fastest[twin(level)]):
                    fastest[twin(level)] = level
        out = [level for level in kept if not level.host_fraction or level.gradients != "stream"
               or fastest[twin(level)] is level]

        def share_step(level: Level) -> float:   # (a twin's step is predicted above: one prediction fewer)
            return step(twin(level)) - saving(level) if twin(level) in levels else step(level)

        first = min((level for level in out if level.host_fraction), key=share_step, default=None)
        if first is not None and first is not out[-1] and step(first) < step(out[0]):   # (the last: `frugal`'s)
            out.remove(first)
            out.insert(0, first)
        return out

    def _grid(self, s: Settings, levels: list[Level]) -> list[list[Settings]]:
        budgets = self._budgets(s)
        return [[_at(s, level, b) for b in budgets] for level in levels]

    def _budgets(self, s: Settings) -> list[str]:
        """SCO's budgets of structure s: none first, every checkpointed boundary last."""
        if "mop.sco.host_budget" in self.fixed:
            return [self.base.mop.sco.host_budget]
        if s.ac_mode == "none":
            return ["0"]
        boundary, layers = self._boundary_bytes(s), self._checkpointed(s)
        return [_byte_text(n * boundary) for n in sorted({math.ceil(q * layers / 4) for q in SCO_QUARTERS})]

    @staticmethod
    def _level_runs(s: Settings, level) -> bool:
        """weights = "stream" reuses an expert block's slot after its forward: every block checkpointed; and
        it holds a window of blocks, where reshard "never" would hold every block (config_checks refuses it)."""
        return level.weights != "stream" or ((s.dispatch == "local" or s.ac_mode == "full") and s.reshard != "never")

    def frugal(self, s: Settings, levels: list[Level] | None = None) -> Evaluation:
        """The knobs that leave the least on the device: every boundary SCO may hold and either the
        whole optimizer state streamed or AdamW on the device (whose moments are smaller than
        OffloadStreamAdamW's staging for a small model), whichever plans less."""
        levels = [level for level in (self._viable_levels(s) if levels is None else levels)
                  if self._level_runs(s, level)]     # (before `_cpu_shares`, which keeps the last and AdamW)
        most = self._budgets(s)[-1]
        e = self.evaluate(_at(s, levels[-1], most))
        on_device = next((level for level in levels if level.optimizer != OFFLOAD_ADAMW), None)
        if e.fits_device or len(levels) == 1 or on_device is None:
            return e
        other = self.evaluate(_at(s, on_device, most))
        return other if other.plan is not None and (e.plan is None or other.device < e.device) else e

    def _viable_levels(self, s: Settings) -> list[Level]:
        """The optimizer levels that can fit s's family (E_p, P, dispatch, Ring-DTP and its schedule,
        checkpointing, tiling, resharding): those that fit the device at the search's fewest tokens per rank
        (S = lcm of the D, the largest D), the smallest c and every boundary on the host. A plan only grows
        from there (with S, N and c), so a level that does not fit there never does; a family with no level
        left (or none that runs with it) is not searched."""
        # keep's twin shares the floor: keep only adds to a plan, so what cannot fit without it cannot with it
        key = (s.expert_degree, s.vocab_degree, s.dispatch, s.ring_dtp, s.ring_schedule, s.ac_mode, s.ffn_tokens,
               s.block_tokens, s.reshard)
        if key not in self._family_floor:
            D, S = max(self.seq_degrees), math.lcm(*self.seq_degrees)
            c = self._token_budgets(s.dispatch, self.base.training.local_batch_size * S // D)[0]
            floor = replace(s, seq_len=S, seq_degree=D, token_budget=c, keep=False)
            # "never" only adds to a plan: its levels are among its "default" twin's
            levels = (self._viable_levels(replace(s, reshard="default"))
                      if s.reshard == "never" and "default" in self.reshards else self.optimizers)
            if not any(self._level_runs(floor, level) for level in levels):
                self._family_floor[key] = []           # (given weights = "stream" beside "never", say)
                return []
            frugal = self.frugal(floor, levels)
            if frugal.plan is None:                    # the job refuses the floor (its batch, say): no pruning
                self._family_floor[key] = levels
            elif not frugal.fits_device:
                self._family_floor[key] = []
            else:
                most, fits = self._budgets(floor)[-1], {}
                for level in levels:
                    # every CPU share plans the same on the device (its cast temporaries): one stands for all
                    plans_as = (level._replace(host_fraction=0.0), level.host_fraction > 0)
                    if plans_as not in fits and self._level_runs(floor, level):
                        fits[plans_as] = self.evaluate(_at(floor, level, most)).fits_device
                self._family_floor[key] = [level for level in levels if fits.get(
                    (level._replace(host_fraction=0.0), level.host_fraction > 0))]
        return self._family_floor[key]

    def _boundary_bytes(self, s: Settings) -> int:
        act = MixedPrecision.from_training(self.base.training).activation_bytes
        return self.base.training.local_batch_size * s.seq_len // s.seq_degree * self.model.args.dim * act

    def _checkpointed(self, s: Settings) -> int:
        key = ("checkpointed", s.ac_mode)
        if key not in self._cache:
            ac = replace(self.base.activation_checkpoint, mode=s.ac_mode)
            self._cache[key] = len(checkpointed_layer_ids(ac, self.model.args.n_layers))
        return self._cache[key]

    def _layout(self, s: Settings):
        key = ("layout", s.seq_degree, s.expert_degree, s.vocab_degree)
        if key not in self._cache:
            self._cache[key] = plan_layout(self.world, s.seq_degree, s.expert_degree, s.vocab_degree)
        return self._cache[key]

    # -- one configuration ------------------------------------------------------------------------

    def predict(self, s: Settings) -> StepPrediction:
        if s not in self._predictions:
            self._predictions[s] = predict_step(self._step_inputs(s))
        return self._predictions[s]

    def _step_inputs(self, s: Settings) -> StepInputs:
        m, t, W = self.model, self.base.training, self.world
        layout = self._layout(s)
        boundary, layers = self._boundary_bytes(s), self._checkpointed(s)
        budget = 0 if s.sco_budget.strip() == "0" else resolve_host_budget(
            s.sco_budget, self.ranks_per_node, available_bytes=self.host_bytes)
        one_step = t.local_batch_size * W // s.seq_degree
        share = parse_device_fraction(s.device_fraction)
        experts, vocab = m.shard_params(layout, s.dispatch)
        act = MixedPrecision.from_training(t).activation_bytes
        return StepInputs(
            model=m.args, active_params=m.active, embedding_params=m.embedding,
            fsdp_params=m.fsdp_params(layout, s.dispatch), local_params=m.local_params(layout, s.dispatch),
            expert_shard_params=experts, vocab_shard_params=vocab, world=W, ranks_per_node=self.ranks_per_node,
            seq_len=s.seq_len, local_batch=t.local_batch_size,
            micro_batches=max(1, t.global_batch_size // one_step) if t.global_batch_size != -1 else 1,
            seq_degree=s.seq_degree, expert_degree=s.expert_degree, vocab_degree=s.vocab_degree,
            dispatch=s.dispatch, token_budget=s.token_budget, max_chunks=self.base.mop.moe.max_chunks,
            ring_dtp=s.ring_dtp, ring_schedule=self._ring_schedule_run(s, act), checkpointed_layers=layers,
            sco_offloaded_bytes=layers * boundary - retained_boundary_bytes([boundary] * layers, budget),
            offload_optimizer=s.offloads_optimizer, device_fraction=0.0 if share == "auto" else share,
            host_fraction=s.host_fraction if s.offloads_optimizer else 0.0,
            stream_weights=s.offloads_optimizer and s.weights == "stream",
            stream_gradients=s.offloads_optimizer and s.gradients == "stream", tiled=s.tiled, keep_attention=s.keep,
            fsdp_gathers=1 if s.reshard == "never" else 2,
            reshard_saved_params=m.regathered_params(layout, s.dispatch) if s.reshard == "never" else 0,
            act_bytes=act)

    def _ring_schedule_run(self, s: Settings, act: int) -> str:
        """The schedule Ring-DTP runs in s: a given "auto" resolved as the plan resolves it."""
        if not s.runs_ring_dtp or s.ring_schedule != "auto":
            return s.ring_schedule
        a = self.model.args
        return ring_dtp_plan_schedule(configure(self.base, s), tokens=self.base.training.local_batch_size
                                      * s.seq_len // s.seq_degree, hidden=a.dim, vocab=a.vocab_size,
                                      vocab_degree=s.vocab_degree, act_bytes=act)

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


def _at(s: Settings, level: Level, sco_budget: str | None = None) -> Settings:
    """s with the optimizer level `level` (and SCO's budget when given)."""
    return replace(s, optimizer=level.optimizer, device_fraction=level.device_fraction, weights=level.weights,
                   gradients=level.gradients, host_fraction=level.host_fraction,
                   sco_budget=s.sco_budget if sco_budget is None else sco_budget)


def _byte_text(n: int) -> str:
    """A byte count as [mop.sco] host_budget takes it: whole GiB or MiB where exact, else bytes with their
    unit ("98304B": config_checks refuses a small count without one as a missing unit)."""
    if n == 0:
        return "0"
    if n % GIB == 0:
        return f"{n // GIB}GiB"
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else f"{n}B"
