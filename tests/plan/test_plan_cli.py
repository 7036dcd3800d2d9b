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


@pytest.mark.parametrize("flags, needles", [
    (("--gpu-memory", "80"), ["--gpu-memory '80' has no unit", "80 bytes", "--gpu-memory 80GiB"]),
    (("--host-memory", "2048"), ["--host-memory '2048' has no unit", "--host-memory 2048GiB"]),
    (("--gpu-memory", "0"), ["--gpu-memory '0' is zero", "e.g. --gpu-memory 80GiB"]),
    (("--host-memory", "0GiB"), ["--host-memory '0GiB' is zero"]),
    (("--world", "0"), ["--world 0 must be >= 1"]),
])
def test_memory_sizes_need_a_unit_and_a_size(capsys, flags, needles):
    """A bare number was bytes (`--gpu-memory 80`: "48.7 GiB of 0.0 GiB per rank: DOES NOT FIT", exit 1):
    bad input (exit 2) naming the flag, the value and the spelling that works, with and without --auto."""
    for auto in ([], ["--auto", "--gpu-memory", "80GiB", "--host-memory", "1TiB"]):
        assert main(["plan", *auto, *flags, DEBUG_CONFIG]) == 2
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, f"{needle!r} missing from: {err}"


AUTO = ["--auto", "--gpu-memory", "80GiB", "--host-memory", "128GiB"]


@pytest.mark.parametrize("argv, needles", [
    # the search kept the given degree, found no valid layout, and said "no layout of the searched degrees is
    # valid for this model" with exit 1, naming neither key nor value
    ([*AUTO, "--world", "2", DEBUG_CONFIG, "--training.seq_len", "4097", "--mop.layout.seq_degree", "2"],
     ["training.seq_len (4097)", "seq_degree (2)"]),
    ([*AUTO, "--world", "2", "--seq-len", "4097", DEBUG_CONFIG, "--mop.layout.seq_degree", "2"],
     ["training.seq_len (4097)"]),
    ([*AUTO, "--world", "8", DEBUG_CONFIG, "--mop.layout.seq_degree", "8"], ["heads (4)", "seq_degree (8)"]),
    # a negative --seq-len reached the plan's bounds: "a bound's bytes must be >= 0, got saved=0, working=-..."
    ([*AUTO, "--seq-len", "-5", DEBUG_CONFIG], ["--seq-len -5 must be >= 1"]),
    # --ranks-per-node 0 was taken as unset: min(W, 8) ranks per node, exit 0
    (["--world", "1", "--ranks-per-node", "0", DEBUG_CONFIG], ["--ranks-per-node = 0 must divide --world = 1"]),
])
def test_given_values_the_plan_cannot_use_are_bad_input(capsys, argv, needles):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} missing from: {err}"


@pytest.mark.parametrize("size", ["0", "2", "0GiB"])
def test_export_refuses_a_shard_size_of_zero_or_without_unit(tmp_path, capsys, size):
    """`--max-shard-size 0` (or a bare number, bytes) wrote one safetensors file per tensor, silently."""
    step = tmp_path / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    code = main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "hf"), "--max-shard-size", size])
    err = capsys.readouterr().err
    assert code == 2 and f"--max-shard-size {size!r} must be a size above zero" in err, err


@pytest.mark.parametrize("argv, key", [
    (["plan", DEBUG_CONFIG, "--training.seq_len", "262144"], "training.seq_len"),
    (["plan", *AUTO, "--seq-len", "262144", DEBUG_CONFIG], "--seq-len"),
    (["plan", *AUTO, DEBUG_CONFIG, "--training.seq_len", "262144"], "training.seq_len"),
])
def test_a_context_past_the_models_max_seq_len_is_bad_input(capsys, argv, key):
    """`plan` printed a plan and "fits" (exit 0); training then failed in every rank's first forward
    with "raise max_seq_len in the model args", which no config key sets."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{key} = 262,144 exceeds model debug's max_seq_len = 131,072" in err, err
    assert f"set {key} to at most 131072" in err, err


def test_a_layout_of_the_config_that_does_not_divide_world_names_key_and_file(capsys):
    """plan_layout's words ("expert_degree (16) must be a positive divisor of the world size (8)") named
    neither the key nor the file that set it."""
    import os

    config = os.path.join(os.path.dirname(DEBUG_CONFIG), "mop_120b.toml")
    assert main(["plan", "--world", "8", config]) == 2
    err = capsys.readouterr().err
    for needle in (config, "mop.layout.expert_degree = 16", "world size (8 ranks)", "valid: [1, 2, 4, 8]"):
        assert needle in err, f"{needle!r} missing from: {err}"
