"""benchmarks/step_profile.py on CPU: the kernel classifier on names as CUDA traces write them, the
trace reader's nesting and kernel-to-op links on a synthetic trace, the timeline arithmetic (idle,
exposed communication) against a brute-force count on random intervals, and the reader on a real
torch.profiler trace of CPU ops."""

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from benchmarks import step_profile as sp
from tests.utils import fresh_seed

V = frozenset({200000, 100000})
CASES = [  # (kernel name, launching op and its ancestors, launching op's input shapes, kind)
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
     ["record_param_comms", "c10d::reduce_scatter_tensor_coalesced_", "FSDP::post_backward_reduce"], None, "communication"),
    ("Memcpy HtoD (Pinned -> Device)", ["aten::copy_", "aten::to"], None, "copies"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", ["aten::copy_", "aten::_to_copy"], None, "copies"),
    ("void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel",
     ["aten::split_with_sizes_copy", "FSDP::all_gather_copy_in"], None, "copies"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4>>",
     ["aten::_scaled_dot_product_flash_attention"], None, "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", ["aten::_efficient_attention_backward"], None, "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ["aten::mm", "aten::matmul"], [[4096, 7168], [7168, 200000]], "vocab_loss"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ["aten::mm", "autograd::engine::evaluate_function: MmBackward0"],
     [[200000, 4096], [4096, 7168]], "vocab_loss"),
    ("void at::native::cunn_SoftMaxForward<4, float, float, float, at::native::LogSoftMaxForwardEpilogue>",
     ["aten::_log_softmax", "aten::log_softmax", "aten::cross_entropy_loss"], [[1024, 200000]], "vocab_loss"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ["aten::mm", "aten::linear"], [[4096, 7168], [7168, 2048]], "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ["aten::addmm"], [[8], [4096, 7168], [7168, 8]],
     "dense_gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::GroupedGemmKernel<...>>", ["aten::_grouped_mm"],
     [[9000, 7168], [64, 7168, 2048], [64]], "expert_gemm"),
    ("void at::native::_fused_adamw_kernel_cuda<float>", ["aten::_fused_adamw_", "Optimizer.step#AdamW.step"], None,
     "optimizer"),
    ("void at::native::embedding_backward_feature_kernel<float, float, long>", ["aten::embedding_dense_backward"],
     [[4096, 7168], [4096], [], [200000]], "elementwise"),
    ("triton_red_fused__to_copy_mul_rsqrt_0", ["Torch-Compiled Region"], None, "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, silu_kernel>", ["aten::silu"], None, "elementwise"),
    ("c10d::allreduce_", ["gloo:all_reduce"], None, "communication"),
    ("nvjet_tst_128x256", ["aten::mm", "aten::linear", "mop_train/models/attention.py(120): forward"],
     [[4096, 7168], [7168, 3072]], "dense_gemm"),
    ("void at::native::elementwise_kernel<add>", ["aten::add", "aten::_scaled_dot_product_attention_math"], None,
     "attention"),
    ("_lse_update_kernel", ["mop_train/ops/ring_dtp/kernels.py(80): lse_update"], None, "vocab_loss"),
]


@pytest.mark.parametrize("name,ancestors,shapes,kind", CASES)
def test_classify(name, ancestors, shapes, kind):
    assert sp.classify(name, ancestors, shapes, V) == kind


def event(name, ts, dur, *, cat="cpu_op", tid=1, ext=None):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": {}}
    if ext is not None:
        e["args"]["External id"] = ext
    return e


def test_kernels_are_tied_to_the_op_that_launched_them_and_its_ancestors():
    trace = {"traceEvents": [
        event("ProfilerStep#2", 0, 1000, cat="user_annotation"),
        event("aten::linear", 10, 100, ext=1), event("aten::mm", 20, 80, ext=2),
        event("aten::_log_softmax", 200, 50, ext=3), event("aten::mm", 300, 10, tid=2, ext=4),  # autograd thread
        event("gemm_kernel_a", 120, 30, cat="kernel", tid=7, ext=2),
        event("softmax_kernel", 260, 20, cat="kernel", tid=7, ext=3),
        event("Memcpy DtoH (Device -> Pinned)", 290, 5, cat="gpu_memcpy", tid=8, ext=9),
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 1},
    ]}
    acts, on_device = sp.activities(trace)
    assert on_device and len(acts) == 3
    by = {a["name"]: a for a in acts}
    assert by["gemm_kernel_a"]["ancestors"] == ["aten::mm", "aten::linear", "ProfilerStep#2"]
    assert by["softmax_kernel"]["ancestors"] == ["aten::_log_softmax", "ProfilerStep#2"]
    assert by["Memcpy DtoH (Device -> Pinned)"]["ancestors"] == [], "no launching op in the trace"
    cpu_only, on_device = sp.activities({"traceEvents": trace["traceEvents"][:5]})
    assert not on_device
    spans = sorted((a["name"], a["ts"], a["dur"]) for a in cpu_only)
    assert spans == [("aten::_log_softmax", 200, 50), ("aten::linear", 10, 10), ("aten::linear", 100, 10),
                     ("aten::mm", 20, 80), ("aten::mm", 300, 10)], "self time: linear less its mm"


def brute(intervals, lo, hi):
    covered = set()
    for s, e in intervals:
        covered.update(range(s, e))
    return len(covered & set(range(lo, hi)))


def test_idle_and_exposed_time_match_a_brute_force_count():
    rng = random.Random(fresh_seed())
    names = {"compute": ("nvjet_gemm", ["aten::mm"]), "comm": ("ncclDevKernel_AllGather", []),
             "copy": ("Memcpy HtoD (Pinned -> Device)", [])}
    acts, by_kind = [], {k: [] for k in names}
    for _ in range(60):
        kind = rng.choice(list(names))
        s = rng.randrange(0, 2000)
        e = s + rng.randrange(1, 120)
        by_kind[kind].append((s, e))
        acts.append({"name": names[kind][0], "ts": s, "dur": e - s, "ancestors": names[kind][1], "shapes": None})
    steps = rng.choice([1, 2, 3])
    b = sp.breakdown(acts, steps=steps)
    lo, hi = min(a["ts"] for a in acts), max(a["ts"] + a["dur"] for a in acts)
    every = [iv for ivs in by_kind.values() for iv in ivs]
    assert b["window_ms_per_step"] == round((hi - lo) / 1e3 / steps, 3)
    assert b["idle"]["ms_per_step"] == round((hi - lo - brute(every, lo, hi)) / 1e3 / steps, 3)
    compute = brute(by_kind["compute"], lo, hi)
    for kind, key in (("comm", "communication"), ("copy", "copies")):
        exposed = brute(by_kind[kind] + by_kind["compute"], lo, hi) - compute
        assert b["kinds"][key]["exposed_ms_per_step"] == round(exposed / 1e3 / steps, 3)
        assert b["kinds"][key]["ms_per_step"] == round(sum(e - s for s, e in by_kind[kind]) / 1e3 / steps, 3)
    assert b["kinds"]["dense_gemm"]["count"] == len(by_kind["compute"])


def test_a_real_cpu_trace_is_read_and_classified(tmp_path):
    torch.manual_seed(fresh_seed())
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(32, 1000, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        F.cross_entropy(x @ w, targets).backward()
        torch.relu(x).sum()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    acts, on_device = sp.activities(json.loads(path.read_text()))
    assert not on_device
    kinds = {a["name"]: sp.classify(a["name"], a["ancestors"], a["shapes"], frozenset({1000})) for a in acts}
    assert kinds["aten::mm"] == "vocab_loss", "the projection to V = 1000 and its gradients"
    assert kinds.get("aten::_log_softmax") == "vocab_loss" and kinds.get("aten::clamp_min", "elementwise") == "elementwise"
    b = sp.breakdown(acts, vocab_dims=frozenset({1000}))
    assert b["kinds"]["vocab_loss"]["count"] >= 3 and 0 <= b["idle"]["pct_of_window"] < 100
    sp.main(["--analyse", str(path), "--vocab", "1000", "--active", "1", "--out", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again" / "step_profile.json").read_text())
    assert again["kinds"] == b["kinds"]
    with pytest.raises(ValueError, match="no activity"):
        sp.breakdown([])


@pytest.mark.parametrize("name,ancestors,phase", [
    ("Memcpy HtoD (Pinned -> Device)", ["aten::copy_", "Optimizer.step#OffloadStreamAdamW.step"], "optimizer"),
    ("nvjet_gemm", ["aten::mm", "autograd::engine::evaluate_function: MmBackward0"], "backward"),
    ("Memcpy DtoH (Device -> Pinned)", ["aten::copy_", "ToCopyBackward0"], "backward"),
    ("nvjet_gemm", ["aten::mm", "aten::linear", "ProfilerStep#3"], "forward"),
])
def test_phase_of_an_activity(name, ancestors, phase):
    assert sp.phase_of(name, ancestors) == phase


def test_link_phases_match_a_brute_force_count():
    """Each bin goes to the phase whose activities cover most of it; per phase, the busy share of each copy
    direction and of compute over that phase's bins, recounted microsecond by microsecond."""
    rng = random.Random(fresh_seed())
    kinds = {"h2d": "Memcpy HtoD (Pinned -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)",
             "compute": "nvjet_gemm", "comm": "ncclDevKernel_AllGather"}
    parents = {"forward": ["aten::linear"], "backward": ["autograd::engine::evaluate_function: MmBackward0"],
               "optimizer": ["Optimizer.step#OffloadStreamAdamW.step"]}
    acts = []
    for _ in range(80):
        kind, phase = rng.choice(list(kinds)), rng.choice(list(parents))
        s = rng.randrange(0, 3000)
        acts.append({"name": kinds[kind], "ts": s, "dur": rng.randrange(1, 200), "ancestors": parents[phase],
                     "shapes": None, "kind": kind, "phase": phase})
    width, steps = rng.choice([50, 100, 250]), rng.choice([1, 2])
    lp = sp.link_phases(acts, steps=steps, bin_us=width)
    start, end = min(a["ts"] for a in acts), max(a["ts"] + a["dur"] for a in acts)
    owner = {}
    for b in range(math.ceil((end - start) / width)):
        lo, hi = start + b * width, min(end, start + (b + 1) * width)
        cover = {p: sum(max(0, min(hi, a["ts"] + a["dur"]) - max(lo, a["ts"])) for a in acts if a["phase"] == p)
                 for p in parents}
        if any(cover.values()):
            owner[b] = max(sp.PHASES, key=lambda p: cover[p])
    for p in parents:
        bins = [b for b, q in owner.items() if q == p]
        us = {t for b in bins for t in range(start + b * width, min(end, start + (b + 1) * width))}
        row = lp["phases"][p]
        assert row["ms_per_step"] == round(len(us) / 1e3 / steps, 3)
        for lane in ("h2d", "d2h", "compute"):
            busy = {t for a in acts if a["kind"] == lane for t in range(a["ts"], a["ts"] + a["dur"])} & us
            assert row[f"{lane}_busy_pct"] == (round(100 * len(busy) / len(us), 1) if us else 0.0), (p, lane)


def test_idle_gaps_are_charged_to_the_sync_that_opened_them_or_to_the_next_launch():
    """Device busy [0, 100), idle [100, 400) after aten::item's cudaStreamSynchronize returns at 102,
    busy [400, 450) and [445, 500) on two streams (no gap), idle [500, 560) with no sync (launch-bound,
    the next kernel launched by aten::mm under aten::linear), busy [560, 600), a 20 us gap (below the
    threshold) and [620, 640). Two steps: every figure is halved."""
    trace = {"traceEvents": [
        event("ProfilerStep#1", 0, 700, cat="user_annotation"),
        event("Block.forward", 1, 300, cat="user_annotation"),
        event("aten::item", 20, 90), event("aten::_local_scalar_dense", 21, 88),
        event("cudaStreamSynchronize", 22, 80, cat="cuda_runtime"),
        event("aten::linear", 380, 40, ext=5), event("aten::mm", 390, 25, ext=6),
        event("aten::linear", 520, 40, ext=7), event("aten::mm", 530, 25, ext=8),
        event("cudaMemcpyAsync", 10, 5, cat="cuda_runtime"),             # ends long before any gap
        event("cudaMemcpyAsync", 510, 20, cat="cuda_runtime"),           # queued inside a gap: blocked nothing
        {**event("cudaMemcpyAsync", 480, 30, cat="cuda_runtime"), "args": {"correlation": 77}},  # pinned: neither
        {**event("Memcpy HtoD (Pinned -> Device)", 420, 1, cat="gpu_memcpy", tid=9), "args": {"correlation": 77}},
        event("k0", 0, 100, cat="kernel", tid=7, ext=1),
        event("k1", 400, 50, cat="kernel", tid=7, ext=6),
        event("Memcpy HtoD (Pinned -> Device)", 445, 55, cat="gpu_memcpy", tid=8, ext=2),
        event("k2", 560, 40, cat="kernel", tid=7, ext=8),
        event("k3", 620, 20, cat="kernel", tid=7, ext=9),
    ]}
    ic = sp.idle_causes(trace, steps=2, min_gap_us=50)
    assert ic["gaps"] == 2 and ic["gaps_ms_per_step"] == pytest.approx((300 + 60) / 2e3)
    assert ic["sync_ms_per_step"] == pytest.approx(300 / 2e3)
    by = {x["cause"]: x for x in ic["attributed"]}
    assert set(by) == {"sync: cudaStreamSynchronize in aten::_local_scalar_dense < aten::item < Block.forward",
                       "launch: aten::mm < aten::linear"}, by
    assert by["launch: aten::mm < aten::linear"]["ms_per_step"] == pytest.approx(0.03)
    assert "after host syncs" in sp.format_idle_causes(ic)
    assert sp.idle_causes(trace, steps=2, min_gap_us=10)["gaps"] == 3


def test_idle_causes_on_random_timelines_sum_to_the_gaps():
    """The charged time is the sum of the gaps of at least the threshold between merged device activity."""
    rng = random.Random(fresh_seed())
    for _ in range(20):
        kernels = [(rng.uniform(0, 5000), rng.uniform(1, 200)) for _ in range(rng.randint(2, 40))]
        trace = {"traceEvents": [event(f"k{i}", t, d, cat="kernel", tid=rng.choice([7, 8]), ext=i)
                                 for i, (t, d) in enumerate(kernels)]}
        spans, gaps, end = sorted((t, t + d) for t, d in kernels), [], None
        for s, e in spans:
            if end is not None and s - end >= 50:
                gaps.append(s - end)
            end = e if end is None else max(end, e)
        ic = sp.idle_causes(trace, min_gap_us=50)
        assert ic["gaps"] == len(gaps) and ic["gaps_ms_per_step"] == pytest.approx(round(sum(gaps) / 1e3, 3))
        assert ic["sync_ms_per_step"] == 0 and all(x["cause"] == "launch: (no CPU op)" for x in ic["attributed"])


def test_idle_causes_name_our_python_frames_when_the_trace_has_them():
    """With --with-stack the cause names the innermost op and the two innermost frames of real code,
    not torch's module and dispatch wrappers."""
    trace = {"traceEvents": [
        event("mop_train/train/loop.py(150): train_step", 0, 900, cat="python_function"),
        event("mop_train/parallel/sharding.py(120): total_grad_norm", 300, 200, cat="python_function"),
        event("torch/nn/modules/module.py(1783): _call_impl", 305, 190, cat="python_function"),
        event("mop_train/parallel/sharding.py(95): grad_norm_terms", 310, 180, cat="python_function"),
        event("torch/_ops.py(1257): __call__", 315, 170, cat="python_function"),
        event("aten::_foreach_norm", 320, 100, ext=2),
        event("k0", 0, 100, cat="kernel", tid=7, ext=1),
        event("k1", 400, 50, cat="kernel", tid=7, ext=2),
    ]}
    ic = sp.idle_causes(trace, min_gap_us=50)
    assert [x["cause"] for x in ic["attributed"]] == [
        "launch: aten::_foreach_norm < mop_train/parallel/sharding.py(95): grad_norm_terms < "
        "mop_train/parallel/sharding.py(120): total_grad_norm"], ic
