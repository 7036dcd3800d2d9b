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


@pytest.mark.parametrize("flags", [("--world", "4", "--ranks-per-node", "3"), ("--world", "12"),
                                   ("--world", "4", "--ranks-per-node", "-2")])
def test_nodes_of_unequal_ranks_are_refused(capsys, flags):
    assert main(["plan", *flags, DEBUG_CONFIG]) == 2
    err = capsys.readouterr().err
    assert "must divide --world" in err and "--ranks-per-node as one of" in err


def test_plan_takes_job_config_file_anywhere_and_world_defaults_to_one(capsys):
    """torchtitan's `--job.config_file X.toml` gives the same plan as the positional path, before or
    after the plan's own options and the overrides; without --world the plan is for one rank."""
    main(["plan", "--world", "4", DEBUG_CONFIG, *LAYOUT])
    want = capsys.readouterr().out
    for argv in (["plan", "--job.config_file", DEBUG_CONFIG, "--world", "4", *LAYOUT],
                 ["plan", "--world", "4", f"--job.config_file={DEBUG_CONFIG}", *LAYOUT],
                 ["plan", "--world", "4", *LAYOUT, "--job.config-file", DEBUG_CONFIG]):
        assert main(argv) == 0, argv
        assert capsys.readouterr().out == want, argv
    assert main(["plan", DEBUG_CONFIG]) == 0
    assert capsys.readouterr().out.startswith("MoP layout: W=1 ranks")


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--job.config_file", DEBUG_CONFIG, DEBUG_CONFIG], "give the config once"),
    (["plan", "--job.config_file", DEBUG_CONFIG, "--job.config_file", DEBUG_CONFIG], "given twice"),
    (["plan", "--world", "2"], "needs the job's TOML"),
    (["train", "--job.config_file"], "needs a value"),
])
def test_a_config_given_twice_or_not_at_all_is_refused(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_train_parses_job_config_file_as_the_positional_path():
    from mop_train.cli import build_parser, config_flag_as_path

    argv = ["train", "--job.config_file", "x.toml", "--nproc-per-node", "2", "--training.steps", "5",
            "--checkpoint.enable"]
    args = build_parser().parse_args(config_flag_as_path(argv))
    assert (args.config, args.nproc_per_node, args.overrides) == ("x.toml", 2, ["--training.steps", "5",
                                                                                "--checkpoint.enable"])
    same = build_parser().parse_args(["train", "--nproc-per-node", "2", "x.toml", "--training.steps", "5",
                                      "--checkpoint.enable"])
    assert vars(same) == vars(args)
