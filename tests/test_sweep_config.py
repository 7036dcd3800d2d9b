"""A sweep's configuration errors are found in the sweep's process, not by launching torchrun: flags
every point shares stop the sweep before its first launch; a value the layout cannot take is a failed
point that was never launched; nonsense sweep flags are refused."""

import os
from types import SimpleNamespace

import pytest

from mop_train import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CONFIG = os.path.join(REPO, "configs", "debug_cpu.toml")


def args_for(tmp_path, **kw):
    return SimpleNamespace(**{**dict(config=DEBUG_CONFIG, nproc=2, steps=2, timeout=60, budget_s=None, bisect=None,
                                     root=str(tmp_path / "runs"), out=str(tmp_path / "res.json"), overrides=[]),
                              **kw})


@pytest.fixture
def no_launch(monkeypatch):
    def launched(*_args, **_kwargs):
        raise AssertionError("a point was launched")
    monkeypatch.setattr(sweep, "launch", launched)


SEQ = lambda s: ["--training.seq_len", str(s), "--training.local_batch_size", "1"]  # noqa: E731


@pytest.mark.parametrize("overrides, needle", [
    (["--mop.layout.seq_degree", "4"], "mop.layout.seq_degree = 4 must divide the world size (2 ranks)"),
    (["--optimizer.lr", "-1"], "optimizer.lr = -1.0"),
    (["--traning.steps", "3"], "did not parse"),
])
def test_flags_every_point_shares_stop_the_sweep_before_any_launch(tmp_path, no_launch, overrides, needle):
    args = args_for(tmp_path, overrides=overrides)
    with pytest.raises(SystemExit) as info:
        sweep.sweep("context", "seq_len", SEQ, args, values=[64, 128])
    assert "nothing was launched" in str(info.value) and needle in str(info.value), str(info.value)
    assert not os.path.exists(args.out)


def test_a_point_the_layout_cannot_take_fails_unlaunched_and_the_sweep_goes_on(tmp_path, no_launch):
    args = args_for(tmp_path, overrides=["--mop.layout.seq_degree", "2"])
    points = sweep.sweep("context", "seq_len", SEQ, args, values=[63, 65])
    assert [p["status"] for p in points] == ["failed", "failed"]
    for p in points:
        assert p["error"].startswith("configuration (not launched):") and f"({p['seq_len']})" in p["error"]


@pytest.mark.parametrize("kw, needle", [({"nproc": 0}, "--nproc 0"), ({"steps": 0}, "--steps 0"),
                                        ({"timeout": 0}, "--point-timeout 0")])
def test_nonsense_sweep_flags_are_refused(tmp_path, no_launch, kw, needle):
    with pytest.raises(SystemExit, match=needle):
        sweep.sweep("context", "seq_len", SEQ, args_for(tmp_path, **kw), values=[64])
