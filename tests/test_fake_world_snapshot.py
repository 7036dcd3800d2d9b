"""benchmarks/fake_world.py's snapshot tools on synthetic allocator histories (no GPU): `snapshot_peak`
finds the largest total inside the event window and groups what was alive then by owner, and
`write_snapshot` keeps the file under its limit by cutting frames."""

from __future__ import annotations

import gzip
import pickle
import random

from benchmarks import fake_world as fw
from tests.utils import fresh_seed

GIB = 2**30
MIB16 = 2**24


def _frame(path: str, line: int, name: str = "f") -> dict:
    return {"filename": path, "line": line, "name": name}


def _history(rng: random.Random):
    """A random allocator history: blocks made before recording (no frames), allocations and frees in
    the window from three owners (one with no Python stack), blocks made before the window and freed in
    it, addresses reused after their free, and the exact peak and make-up at it."""
    owners = [[_frame("/site/torch/x.py", 1), _frame("/r/mop_train/ops/a.py", 10, "alloc_a")],
              [_frame("/r/mop_train/models/b.py", 20, "alloc_b")], []]
    base = 1 << 40
    resident = [(base + i * 64 * GIB, rng.randint(1, 5) * GIB) for i in range(3)]      # alive throughout
    # made in the step before the window's first event (the ring buffer dropped their allocs), freed in it
    live = {base + 500 * GIB + i * GIB: (rng.randint(1, 64) * MIB16, 3) for i in range(rng.randint(2, 6))}
    events, next_addr, freed = [], base + 1000 * GIB, []
    total = sum(s for _, s in resident) + sum(s for s, _ in live.values())
    best, best_live = total, dict(live)
    for _ in range(rng.randint(20, 200)):
        early = [a for a, (_, o) in live.items() if o == 3]
        if early and rng.random() < 0.3 or live and rng.random() < 0.45:
            addr = rng.choice(early or sorted(live))
            size, owner = live.pop(addr)
            events.append({"action": "free_requested", "addr": addr, "size": size, "frames": []})
            events.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})
            freed.append(addr)
            total -= size
        else:
            owner = rng.randrange(3)
            size = rng.randint(1, 64) * MIB16
            if freed and rng.random() < 0.4:     # the allocator hands a freed address out again
                addr = freed.pop(rng.randrange(len(freed)))
            else:
                addr, next_addr = next_addr, next_addr + GIB
            live[addr] = (size, owner)
            events.append({"action": "alloc", "addr": addr, "size": size, "frames": owners[owner]})
            total += size
        if total >= best:   # ties: the latest state, as the backward replay finds it
            best, best_live = total, dict(live)
    segments = [{"address": a, "blocks": [{"size": s, "state": "active_allocated", "frames": []}]}
                for a, s in resident]
    segments += [{"address": a, "blocks": [{"size": s, "state": "active_allocated", "frames": (owners + [[]])[o]},
                                            {"size": MIB16, "state": "inactive"}]} for a, (s, o) in live.items()]
    labels = {0: "ops/a.py:10 alloc_a", 1: "models/b.py:20 alloc_b",
              2: "no Python stack (made on autograd's backward thread)", 3: "made in the step, before the window"}
    make_up = {"made before recording began (parameters, optimizer state)": sum(s for _, s in resident)}
    for size, owner in best_live.values():
        make_up[labels[owner]] = make_up.get(labels[owner], 0) + size
    return {"device_traces": [events], "segments": segments}, best, make_up


def test_snapshot_peak_replays_the_window_to_its_largest_total(tmp_path):
    rng = random.Random(fresh_seed(7350))
    for case in range(60):
        snap, best, make_up = _history(rng)
        path = str(tmp_path / f"s{case}.pickle.gz")
        with gzip.open(path, "wb") as f:
            pickle.dump(snap, f)
        got = fw.snapshot_peak(path, top=10)
        assert abs(got["peak_gib"] - best / GIB) < 1e-12, (got["peak_gib"] * GIB, best)
        want = {k: round(v / GIB, 3) for k, v in make_up.items() if v}
        assert got["make_up_gib"] == want and got["rest_gib"] == 0, (got["make_up_gib"], want)


def test_write_snapshot_cuts_frames_until_it_fits(tmp_path, monkeypatch):
    rng = random.Random(fresh_seed(7351))
    deep = [_frame(f"/r/mop_train/m{i}.py", i) for i in range(30)]
    events = [{"action": "alloc", "addr": i, "size": 512, "frames": [dict(f, line=rng.randint(0, 10**9)) for f in deep]}
              for i in range(400)]
    snap = {"device_traces": [events], "segments": [{"address": 0, "blocks": [{"size": 1, "state": "inactive"}]}]}
    roomy = fw.write_snapshot(pickle.loads(pickle.dumps(snap)), str(tmp_path / "a"))
    assert roomy["frames_kept"] == 8 and roomy["bytes"] <= fw.SNAPSHOT_LIMIT
    monkeypatch.setattr(fw, "SNAPSHOT_LIMIT", roomy["bytes"] // 3)
    tight = fw.write_snapshot(pickle.loads(pickle.dumps(snap)), str(tmp_path / "b"))
    assert tight["frames_kept"] < 8 and tight["bytes"] < roomy["bytes"]
    with gzip.open(tight["path"], "rb") as f:
        back = pickle.load(f)
    assert all(len(e["frames"]) == tight["frames_kept"] for e in back["device_traces"][0])
