"""`mop-train plan --auto` among [mop.offload_adamw] weights / gradients and device_fraction (issue 32, item 4).

Every expectation is derived from the bound functions (mop_train.ops.offload_adamw.memory), from
`plan_for_config` (what the launch plans) and from the search's own rule (fastest predicted that fits;
predictions within TIE_SHARE are a tie, won by the least pinned host memory), not from GiB figures:
  - where memory binds the search streams, and the configuration it picks is the one its rule picks
    from every level it could have tried (each device share with weights and gradients streamed too);
    where everything fits it keeps the weights on the device because its cost model says streaming is
    slower (the streamed bytes beyond the compute, and more optimizer traffic);
  - the plan's `parameters` and `gradients` lines are the bound functions of shapes counted here off a
    meta model, for all five settings, on 8 ranks with every group sharded;
  - a device share beside streaming adds exactly its resident state, on the device and not on the host;
  - the paper point's host plan is the sum of its host terms, and when it exceeds the node the plan
    names the term that binds and a fix that makes it fit;
  - bad values raise ValueError naming key, value and fix.
Model: torchtitan's config validation style (ValueError with the key); the planner is our own."""

import copy
import dataclasses
import functools
import math
import re

import pytest
import torch

from mop_train.cli import main
from mop_train.config import load_job_config
from mop_train.config_checks import validate
from mop_train.models import zoo
from mop_train.models.model import MoETransformer
from mop_train.ops.offload_adamw.device_share import device_bytes_per_element
from mop_train.ops.offload_adamw.memory import StreamSettings, WeightShapes, gradients_bound, weights_bound
from mop_train.layout import plan_layout
from mop_train.plan.auto import TIE_SHARE, AutoPlanner
from mop_train.plan.cost_model import OFFLOAD_S_PER_PARAM
from mop_train.plan.job import plan_for_config
from mop_train.plan.settings import (DEVICE_FRACTIONS, HOST_FRACTIONS, Level, configure, fixed_keys, keeps_no_less,
                                    search_base_flags)
from mop_train.plan.terms import GIB, check_host_memory, host_memory_fix, host_memory_plan
from tests.plan.test_auto_plan import BIG, OSA, SMALL, job, planner, truth

ONE_GPU = dict(world=1, gpu=141 * GIB, host=1024 * GIB, headroom=2 * GIB)
LONG, SHORT = 1 << 20, 4096


def lines(plan, which="device") -> dict:
    return {n: b for n, b, _ in (plan.device_terms if which == "device" else plan.host_terms)}


def fits(p: AutoPlanner, plan) -> bool:
    return plan.device_bytes <= p.gpu_bytes - p.headroom and plan.host_bytes_per_node <= p.host_bytes


UNTILED = ("--mop.tiling.ffn_tokens", "0", "--mop.tiling.block_tokens", "0", "--mop.attention.no-keep")
"""Sequence tiling and keep fixed off: these cases are what streaming alone does where memory binds."""


@functools.lru_cache(maxsize=None)
def searched(S: int, gpu: int = 141 * GIB):
    """`small` (B=1) on one GPU of `gpu` bytes: the planner and its answer at context S."""
    p = planner(SMALL, "--training.local_batch_size", "1", *UNTILED, world=1, gpu=gpu, host=1024 * GIB,
                headroom=2 * GIB)
    return p, p.fastest_at(S)


def every_level(p: AutoPlanner, s):
    """Each knob the search could give structure `s`: every device share with weights and gradients on the
    device, bf16, or streamed, each CPU share, and every SCO budget of its grid (planned by the cached
    planner, which tests/plan/test_auto_plan.py checks against plan_for_config)."""
    budgets = {row.sco_budget for rows in p.knobs(s, p.optimizers) for row in rows}
    for f in DEVICE_FRACTIONS:
        for w, g in (("device", "device"), ("bf16", "device"), ("stream", "stream")):
            for h in (0.0, *HOST_FRACTIONS):
                for b in budgets:
                    yield dataclasses.replace(s, optimizer=OSA, device_fraction=f, weights=w, gradients=g,
                                              host_fraction=h, sco_budget=b)


def assert_chosen_by_the_rule(p: AutoPlanner, chosen):
    """No knob of the chosen structure that fits is predicted faster beyond a tie, nor ties with less host."""
    fitting = [(e.tokens_per_s, e.host, e.settings) for e in map(p.evaluate, every_level(p, chosen.settings)) if e.fits]
    best = max(tps for tps, _, _ in fitting)
    assert chosen.tokens_per_s >= (1 - TIE_SHARE) * best, (chosen.settings.label(), max(fitting, key=lambda t: t[0]))
    tied_host = min(h for tps, h, _ in fitting if tps >= (1 - TIE_SHARE) * best)
    assert chosen.host <= tied_host, [s.label() for tps, h, s in fitting if h < chosen.host and tps >= (1 - TIE_SHARE) * best]


# -- the choice ---------------------------------------------------------------------------------

def test_where_memory_binds_the_search_streams_and_picks_by_its_own_rule():
    p, r = searched(LONG)
    s = r.chosen.settings
    assert (s.weights, s.gradients) == ("stream", "stream") and fits(p, truth(p, s))
    for w, g in (("device", "device"), ("bf16", "device")):   # the case under test: only streaming fits
        assert not fits(p, truth(p, dataclasses.replace(s, weights=w, gradients=g)))
    assert_chosen_by_the_rule(p, r.chosen)


def test_a_device_share_beside_the_streams_is_chosen_when_it_fits():
    """The two compose: on a GPU that fits streaming with a quarter of the state resident but not bf16
    working weights (sized from the plans), the search keeps that quarter on the device (the optimizer
    streams less: predicted no slower, and it pins less host memory)."""
    probe, r = searched(LONG)
    s = r.chosen.settings
    quarter, bf16 = (truth(probe, dataclasses.replace(s, device_fraction=f, weights=w, gradients=g)).device_bytes
                     for f, w, g in (("0.25", "stream", "stream"), ("0", "bf16", "device")))
    assert quarter < bf16, "the setup: a quarter resident beside the streams plans less than bf16 weights"
    gpu = (quarter + bf16) // 2 + 2 * GIB
    p, r = searched(LONG, gpu)
    assert (r.chosen.settings.weights, r.chosen.settings.gradients) == ("stream", "stream")
    assert float(r.chosen.settings.device_fraction) > 0, r.chosen.settings.label()
    assert_chosen_by_the_rule(p, r.chosen)


def test_where_everything_fits_streaming_is_not_paid_for():
    """At 4K the cost model charges streaming the bytes it moves beyond the compute (the `streams` term)
    and the gradients and working copies through the optimizer: slower, so not chosen though it fits."""
    p, r = searched(SHORT)
    s = r.chosen.settings
    assert (s.weights, s.gradients) == ("device", "device")
    offloaded = dataclasses.replace(s, optimizer=OSA, device_fraction="0")
    streamed = dataclasses.replace(offloaded, weights="stream", gradients="stream")
    assert fits(p, truth(p, streamed)), "streaming fits: it is left out for its speed, not its memory"
    terms = {n: t for n, t, _ in p.predict(streamed).terms}
    assert terms["streams"] > 0 and p.predict(streamed).seconds > p.predict(offloaded).seconds
    assert p.predict(streamed).tokens_per_s < (1 - TIE_SHARE) * r.chosen.tokens_per_s
    assert_chosen_by_the_rule(p, r.chosen)


def test_streaming_never_predicts_faster_and_a_share_streams_less():
    """The cost model's rule at any context: streaming adds link bytes, it never removes any; a device
    share beside streaming streams the optimizer state of the rest only, but every element's gradient
    and working copy still cross the link."""
    p = searched(SHORT)[0]
    for S in (SHORT, LONG):
        s = dataclasses.replace(p.structures(S)[0], optimizer=OSA)
        for f in DEVICE_FRACTIONS:
            dd = p.predict(dataclasses.replace(s, device_fraction=f))
            ss = p.predict(dataclasses.replace(s, device_fraction=f, weights="stream", gradients="stream"))
            assert ss.seconds >= dd.seconds
        opt = {f: dict((n, t) for n, t, _ in p.predict(dataclasses.replace(
            s, device_fraction=f, weights="stream", gradients="stream")).terms)["optimizer"] for f in ("0", "1")}
        grads_in = 4 * p.model.local_params(plan_layout(1, 1, 1, 1), s.dispatch)
        assert OFFLOAD_S_PER_PARAM * grads_in / 12 <= opt["1"] < opt["0"], \
            "a full share still copies each gradient in (4 B) and its working copy out"


def test_the_pruning_order_is_the_plans_order():
    """settings.keeps_no_less (the search's pruning) holds on the plans it prunes by: a level it says
    keeps no less on the device does, and pins no more host memory (CPU shares included: their cast
    temporaries on the device, their gradient buffer on the host beside gradients on the device)."""
    p, r = searched(LONG)
    s = r.chosen.settings
    levels = [Level(OSA, f, w, g, h) for f in DEVICE_FRACTIONS for h in (0.0, 0.3, 0.7)
              for w, g in (("device", "device"), ("bf16", "device"), ("stream", "stream"), ("stream", "device"))]
    plans = {lv: p.evaluate(dataclasses.replace(s, device_fraction=lv.device_fraction, weights=lv.weights,
                                                gradients=lv.gradients, host_fraction=lv.host_fraction)).plan
             for lv in levels}
    ordered = 0
    for a in levels:
        for b in levels:
            if keeps_no_less(a, b):
                ordered += a != b
                assert plans[a].device_bytes >= plans[b].device_bytes, (a, b)
                assert plans[a].host_bytes_per_node <= plans[b].host_bytes_per_node, (a, b)
    assert ordered > len(levels), "the order relates levels across settings, not only along one share"
    assert not keeps_no_less(Level(OSA, "0.75", "device", "device"), Level(OSA, "0.75", "bf16", "device"))  # 4+6 < 2+9 B
    share, none = Level(OSA, "0.5", "device", "device", 0.3), Level(OSA, "0.5", "device", "device")
    assert plans[share].device_bytes > plans[none].device_bytes and plans[share].host_bytes_per_node > plans[
        none].host_bytes_per_node, "the case under test: a CPU share plans more on both sides"
    assert not keeps_no_less(none, share) and not keeps_no_less(share, none)


# -- the launch check on what the search returns ------------------------------------------------

@pytest.mark.parametrize("given,S", [(("--mop.offload_adamw.device_fraction", "0.5"), 7 << 17),
                                     (("--mop.offload_adamw.host_fraction", "0.3"), LONG)])
def test_what_the_search_returns_the_launch_accepts(given, S):
    """The CLI's own check (the chosen flags parse and validate, as at launch) and plan_for_config's fit,
    with a given device share or a CPU share (each composes with the streams: the CPU share reads the
    streamed gradients in host memory)."""
    base = ("configs/small_1gpu.toml", "--training.local_batch_size", "1", "--optimizer.name", OSA, *UNTILED, *given)
    p = planner(*base, **ONE_GPU)
    r = p.fastest_at(S)
    s = r.chosen.settings
    cfg = load_job_config(["--job.config_file", *base, *s.flags(p.base)], model_flavors=zoo.names())
    assert fits(p, plan_for_config(cfg, world=1, ranks_per_node=1, host_bytes=p.host_bytes))
    assert s.weights == "stream", "memory binds: the weights stream"
    assert cfg.mop.offload_adamw.host_fraction == p.base.mop.offload_adamw.host_fraction
    assert s.gradients == "stream", "memory binds: the gradients stream too (beside either share)"
    if given[0].endswith("device_fraction"):
        assert s.device_fraction == "0.5"
    for e in r.runners_up:                  # (the launch's value checks; the chosen one was loaded above)
        validate(configure(p.base, e.settings))


def test_a_given_host_init_keeps_the_weights_off_the_device_and_the_launch_accepts_the_choice():
    """`--mop.offload_adamw.host_init` given to `plan --auto`: the job loads (the search's base flags give it
    weights off the device, since host_init refuses weights = "device"), every configuration the search
    plans is OffloadStreamAdamW with bf16 or streamed weights, and the chosen flags, which name host_init,
    load as the launch loads them, plan host_init's start-up and host terms, and fit."""
    given = ("--training.local_batch_size", "1", "--mop.offload_adamw.host_init")
    fixed = fixed_keys(list(given))
    base = ("configs/small_1gpu.toml", *search_base_flags(fixed), *given)
    p = AutoPlanner(job(*base), fixed=fixed, world=1, ranks_per_node=1, gpu_bytes=141 * GIB,
                    host_bytes=1024 * GIB, headroom=2 * GIB)
    assert p.optimizers and all(lv.optimizer == OSA and lv.weights != "device" for lv in p.optimizers), p.optimizers
    r = p.fastest_at(SHORT)
    planned = list(p._memo)
    assert planned and all(s.offloads_optimizer and s.weights != "device" for s in planned)
    flags = r.chosen.settings.flags(p.base)
    assert "--mop.offload_adamw.host_init" in flags
    cfg = load_job_config(["--job.config_file", "configs/small_1gpu.toml", "--training.local_batch_size", "1", *flags],
                          model_flavors=zoo.names())   # (the chosen flags and the given keys not searched)
    assert cfg.mop.offload_adamw.host_init and cfg.mop.offload_adamw.weights == r.chosen.settings.weights
    plan = plan_for_config(cfg, world=1, ranks_per_node=1, host_bytes=p.host_bytes)
    assert fits(p, plan) and "start-up values" in lines(plan, "host")
    assert (plan.device_bytes, plan.host_bytes_per_node) == (r.chosen.device, r.chosen.host)


# -- the lines against the bound functions -------------------------------------------------------

SHARDED = ("configs/small_1gpu.toml", "--training.seq_len", "65536", "--training.local_batch_size", "1",
           "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "4", "--mop.layout.vocab_degree", "2",
           "--mop.moe.dispatch", "pipelined_llep", "--optimizer.name", OSA)
W8 = 8
SETTINGS = (("device", "device"), ("bf16", "device"), ("bf16", "stream"), ("stream", "device"), ("stream", "stream"))


def sharded_plan(training: dict | None = None, **offload):
    """plan_for_config of SHARDED on 8 ranks with [mop.offload_adamw] `offload` (and [training] changes)."""
    base = job(*SHARDED)
    cfg = copy.copy(base)
    cfg.mop = copy.copy(base.mop)
    cfg.mop.offload_adamw = dataclasses.replace(base.mop.offload_adamw, **offload)
    cfg.training = dataclasses.replace(base.training, **(training or {}))
    validate(cfg)                                                  # the launch's checks of the settings
    return plan_for_config(cfg, world=W8, ranks_per_node=W8, host_bytes=2048 * GIB)


@functools.lru_cache(maxsize=None)
def meta_shapes() -> tuple[int, int, int, int, int]:
    """(N local params, largest FSDP2 unit's shard, largest block kept out of FSDP2, vocab shard, the root
    unit's local params) of `small` at W=8, E_p=4, P=2, counted off a meta model here."""
    args = zoo.get_model_args("small")
    with torch.device("meta"):
        model = MoETransformer(args)
    layers = [m.experts for m in model.moe_layers()]
    experts, projection = sum(p.numel() for e in layers for p in e.parameters()), model.output.weight.numel()
    kept = {id(p) for e in layers for p in e.parameters()} | {id(model.output.weight)}
    unit = max(sum(p.numel() for p in b.parameters() if id(p) not in kept) for b in model.layers.values())
    in_blocks = {id(p) for b in model.layers.values() for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    dense = sum(p.numel() for p in model.parameters()) - experts - projection
    mine = -(-dense // W8) + -(-experts // 4) + -(-projection // 2)
    layer = max(sum(p.numel() for p in e.parameters()) for e in layers) // 4
    return mine, -(-unit // W8), max(layer, -(-projection // 2)), -(-projection // 2), \
        -(-(root - projection) // W8) + -(-projection // 2)


def test_parameters_and_gradients_lines_are_the_bound_functions_on_8_ranks():
    mine, unit, block, vocab, _ = meta_shapes()
    shapes = WeightShapes(mine, unit, block, vocab, 2)
    plans = {(w, g): sharded_plan(weights=w, gradients=g) for w, g in SETTINGS}
    got = {k: lines(v) for k, v in plans.items()}
    assert plans["device", "device"].local_params == mine
    for (w, g), line in got.items():
        device_grads = got["device", "device"]["gradients"]
        # streamed, nothing stays in backward: the head unit's gradients leave after the loss's backward,
        # each block's after its own, the embedding's form at the very end (here a block's backward binds)
        assert "block backward)" in dict((n, h) for n, _, h in plans[w, g].device_terms)["gradients"]
        assert line["parameters"] == weights_bound(StreamSettings(w, g), shapes).device_bytes, (w, g)
        assert line["gradients"] == gradients_bound(StreamSettings(w, g), shapes, device_grads=device_grads,
                                                    retained_grads=0).device_bytes, (w, g)
    assert device_grads == 4 * mine, "fp32 gradients of every local param"
    assert got["bf16", "device"]["parameters"] * 2 == got["device", "device"]["parameters"] == 4 * mine
    # stream: window slots x (the largest unit's shard + the largest kept-out block) in bf16, + the fp32 vocab shard
    assert got["stream", "stream"]["parameters"] == 2 * (unit + block) * 2 + 4 * vocab
    assert got["stream", "stream"]["gradients"] == 4 * (2 * unit + block)  # no root unit's gradients held
    wider = lines(sharded_plan(weights="stream", weight_window=3))
    assert wider["parameters"] - got["stream", "device"]["parameters"] == (unit + block) * 2, "one slot more"


def test_with_micro_batches_the_streamed_gradients_hold_one_running_sum_more():
    mine, unit, block, vocab, root = meta_shapes()
    micro_plan = sharded_plan(dict(global_batch_size=2 * W8 // 2), weights="stream", gradients="stream")
    assert micro_plan.micro_batches == 2
    micro, one = lines(micro_plan), lines(sharded_plan(weights="stream", gradients="stream"))
    assert micro["gradients"] - one["gradients"] == 4 * max(unit, block)


# -- a device share beside the streams -----------------------------------------------------------

@pytest.mark.parametrize("w,g", [("stream", "stream"), ("bf16", "device"), ("device", "device")])
def test_a_device_share_adds_its_resident_state_once(w, g):
    """Against the plan at share 0: the parameters and gradients lines do not change, the optimizer line
    and the total grow by the share's resident bytes (8 B per element for fp32 shards, their own
    masters, else 12 B), and the host's optimizer state shrinks by its 12 B per element; the host plan
    is the sum of its terms (the working copies and gradient buffer cover every local element)."""
    plans = {f: sharded_plan(weights=w, gradients=g, device_fraction=f) for f in DEVICE_FRACTIONS}
    mine, zero = plans["0"].local_params, plans["0"]
    per = device_bytes_per_element(fp32_weights=w == "device")
    for f, plan in plans.items():
        share = round(float(f) * mine)
        d, d0, h = lines(plan), lines(zero), lines(plan, "host")
        assert (d["parameters"], d["gradients"]) == (d0["parameters"], d0["gradients"])
        assert d["optimizer"] - d0["optimizer"] == share * per and plan.device_bytes - zero.device_bytes == share * per
        assert h["optimizer state"] == 12 * (mine - share)
        assert h.get("working weights", 0) == (2 * mine if w == "stream" else 0)
        assert h.get("streamed grads", 0) == (4 * mine if g == "stream" else 0)
        assert plan.host_bytes_per_node == W8 * sum(h.values())


# -- the paper point ------------------------------------------------------------------------------

PAPER = ["plan", "--world", "64", "--gpu-memory", "141GiB", "--host-memory", "2TiB", BIG, "--training.seq_len",
         "1048576", "--mop.layout.seq_degree", "16", "--mop.layout.expert_degree", "64", "--mop.layout.vocab_degree",
         "8", "--optimizer.name", OSA, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients", "stream"]


def test_the_paper_point_names_the_host_term_that_binds_and_a_fix_that_fits(capsys):
    """mop-667b at 1M on 64 ranks, stream/stream: the device plan fits in 45 GiB; the node's host plan is
    the sum of the printed host terms times 8; over 2 TiB (SCO's "auto" takes half the node before the
    optimizer and the streams pin theirs) the plan exits 1 naming the term and a host_budget that fits."""
    assert main(PAPER) == 1
    out = capsys.readouterr().out
    host = re.search(r"per-rank pinned host memory.*?\n((?:  .*\n)+)", out).group(1).splitlines()
    terms = {ln[:22].strip(): float(ln[22:].split("GiB")[0]) for ln in host}
    total = terms.pop("total")
    assert math.isclose(total, sum(terms.values()), abs_tol=0.001 * len(terms))
    need = float(re.search(r"host: 8 ranks x [\d.]+ GiB = ([\d.]+) GiB", out).group(1))
    assert math.isclose(need, 8 * total, abs_tol=0.1) and need > 2048
    verdict = next(ln for ln in out.splitlines() if ln.startswith("host:"))
    assert "DOES NOT FIT" in verdict and "sco boundaries" in verdict, verdict
    budget = re.search(r"--mop\.sco\.host_budget (\d+MiB)", verdict).group(1)
    assert main(PAPER + ["--mop.sco.host_budget", budget]) == 0
    out = capsys.readouterr().out
    device = float(re.search(r"device: ([\d.]+) GiB of", out).group(1))
    assert device <= 45 and "host: 8 ranks" in out and "DOES NOT FIT" not in out


def test_the_launch_host_check_names_the_binding_term_too():
    """check_host_memory (the launch) says the same: the largest term, and SCO's budget that fits beside the
    rest (applied, the check passes); when the rest alone is too much, what frees its largest term."""
    def terms(sco: int):
        return host_memory_plan(1 << 30, offload_optimizer=True, sco_host_budget=sco, weights="stream",
                                gradients="stream")
    big = terms(64 << 30)
    available = 2 * (sum(b for _, b, _ in big) - (40 << 30))      # SCO must give up 40 GiB per rank
    with pytest.raises(ValueError, match=r"largest host term is sco boundaries .*--mop\.sco\.host_budget \d+MiB") as err:
        check_host_memory(big, local_ranks=2, available_bytes=available)
    budget = int(re.search(r"host_budget (\d+)MiB", str(err.value)).group(1)) << 20
    check_host_memory(terms(budget), local_ranks=2, available_bytes=available)     # the fix fits
    starved = host_memory_fix(big, local_ranks=2, available_bytes=2 * (8 << 30))  # the rest alone is too much
    assert "optimizer state" in starved and "device_fraction" in starved and "host_budget" not in starved


# -- bad values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    (dict(weights="fast"), ["mop.offload_adamw.weights", "'fast'", "'stream'"]),
    (dict(gradients="bf16"), ["mop.offload_adamw.gradients", "'bf16'", "'device'"]),
    (dict(weights="stream", weight_window=0), ["mop.offload_adamw.weight_window", "0", ">= 1"]),
    (dict(weights="stream", weight_window=True), ["mop.offload_adamw.weight_window", "True", "int"]),
])
def test_the_bound_refuses_settings_it_cannot_size(kwargs, words):
    """Before: weights = "fast" was sized as "stream", weight_window = 0 as no slot at all."""
    with pytest.raises(ValueError) as err:
        StreamSettings(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("text,words", [
    ('weights = "fast"', ["mop.offload_adamw.weights", "fast"]),
    ('gradients = "bf16"', ["mop.offload_adamw.gradients", "bf16"]),
])
def test_a_config_file_with_a_bad_setting_names_it(tmp_path, text, words):
    path = tmp_path / "job.toml"
    path.write_text(f'[optimizer]\nname = "{OSA}"\n[mop.offload_adamw]\n{text}\n')
    with pytest.raises(ValueError) as err:
        load_job_config(["--job.config_file", str(path)], model_flavors=zoo.names())
    assert all(w in str(err.value) for w in words), str(err.value)
