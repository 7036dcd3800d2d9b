"""`mop-train plan`: the job's per-rank plan without launching; exit 1 with the numbers when it does not fit."""

import re

import pytest

from mop_train.cli import main
from tests.train.cli import DEBUG_CONFIG

LAYOUT = ["--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2", "--mop.layout.vocab_degree", "2",
          "--mop.moe.dispatch", "ep"]


def test_plan_fits_and_does_not_fit(capsys):
    assert main(["plan", "--world", "4", "--gpu-memory", "80GiB", "--host-memory", "64GiB", DEBUG_CONFIG, *LAYOUT]) == 0
    out = capsys.readouterr().out
    assert "seq D=2" in out and "B*S/D*H" in out and "device:" in out and "fits" in out
    assert main(["plan", "--world", "4", "--gpu-memory", "1MiB", DEBUG_CONFIG, *LAYOUT]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_plan_halves_activation_terms_with_the_sequence_degree(capsys):
    def terms(degree):
        main(["plan", "--world", "4", DEBUG_CONFIG, "--training.seq_len", "65536",
              "--mop.layout.seq_degree", str(degree)])
        rows = [re.match(r"  (\S+(?: \S+)*?)\s+([\d.]+) GiB", line) for line in capsys.readouterr().out.splitlines()]
        return {m.group(1): float(m.group(2)) for m in rows if m}
    one, two = terms(1), terms(2)
    assert two["boundaries"] == pytest.approx(one["boundaries"] / 2, abs=2e-3)
    assert two["block"] == pytest.approx(one["block"] / 2, abs=2e-3)
    assert one["boundaries"] > 0.1   # large enough for the halving to be seen at 3 decimals


def test_plan_rejects_an_impossible_layout(capsys):
    assert main(["plan", "--world", "4", DEBUG_CONFIG, "--mop.layout.seq_degree", "3"]) == 2
    assert "seq_degree" in capsys.readouterr().err
