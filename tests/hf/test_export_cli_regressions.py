"""Regressions of `mop-train export` and the HF import found by a probe of the CLI (CPU, fp32 checkpoints).

- A --checkpoint that does not exist, with --flavor, was reported as "manifest.json: missing, so the
  checkpoint was never completed"; DUMP/checkpoint (the step folders' parent) without --flavor as "no
  mop_model.json of the run above" (the record was there), with --flavor as the missing manifest.
- The manifest check (a read of every file) ran before the --out, tokenizer, --max-shard-size and
  flavor checks, which read no data.
- --dtype float16 wrote weights above 65504 as inf (the import then refused them); a failure partway
  through writing (that refusal now, a full disk) left the files written so far in --out.
- An HF folder with multi-token-prediction layers (num_nextn_predict_layers > 0, as DeepSeek-V3's
  published checkpoints) was imported without a word about them.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat

import pytest
import torch

from mop_train.cli import main
from mop_train.hf import dcp_chunks
from mop_train.hf.export import export_checkpoint
from mop_train.hf.run_record import write_run_record
from mop_train.train import integrity
from tests.hf.checkpoints import debug_args, random_model, save_dcp
from tests.utils import fresh_seed


def _export(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["export", *argv])
    return code, err.getvalue()


def _run(tmp_path, seed: int, model=None) -> tuple:
    """A run's dump folder with its record and checkpoint/step-3: (args, dump, step folder)."""
    args = debug_args()
    dump = tmp_path / "run"
    step = save_dcp(model or random_model(args, fresh_seed(seed)), str(dump / "checkpoint" / "step-3"))
    write_run_record(str(dump), flavor="debug", args=args, tokenizer_folder=None, checkpoint_folder="checkpoint")
    return args, dump, step


@pytest.mark.parametrize("flavor", [[], ["--flavor", "debug"]])
def test_a_checkpoint_folder_that_does_not_exist_is_named(tmp_path, flavor):
    _, dump, _ = _run(tmp_path, 200)
    for missing, beside in ((tmp_path / "nope" / "step-1", "nor does"), (dump / "checkpoint" / "step-4", "step-3")):
        code, err = _export(["--checkpoint", str(missing), "--out", str(tmp_path / "hf"), *flavor])
        assert code == 2
        assert f"checkpoint folder {missing} does not exist" in err and beside in err, err
        assert "DUMP/checkpoint/step-N" in err and "manifest" not in err and "mop_model.json" not in err, err
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("flavor", [[], ["--flavor", "debug"]])
def test_the_checkpoints_parent_folder_lists_its_step_folders(tmp_path, flavor):
    args, dump, _ = _run(tmp_path, 201)
    save_dcp(random_model(args, 0), str(dump / "checkpoint" / "step-10"))
    code, err = _export(["--checkpoint", str(dump / "checkpoint"), "--out", str(tmp_path / "hf"), *flavor])
    assert code == 2
    assert "the checkpoints' parent folder" in err and "step-3, step-10" in err, err
    assert f"--checkpoint {dump / 'checkpoint' / 'step-10'} (the newest)" in err, err
    assert "manifest" not in err and "mop_model.json" not in err, err


def test_every_argument_check_runs_before_any_data_is_read(tmp_path, monkeypatch):
    _, _, step = _run(tmp_path, 202)

    def no_read(*_args, **_kw):
        raise AssertionError("checkpoint data read before the argument checks")

    monkeypatch.setattr(integrity, "sha256", no_read)            # the manifest check's read
    monkeypatch.setattr(dcp_chunks.DCPChunks, "read", no_read)   # the export's read
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    (tmp_path / "afile").write_text("")
    (tmp_path / "tok").mkdir()
    out = ["--out", str(tmp_path / "hf")]
    cases = [(["--out", str(full)], "not empty"), (["--out", str(tmp_path / "afile")], "is a file"),
             ([*out, "--tokenizer", str(tmp_path / "tok")], "has no tokenizer.json"),
             ([*out, "--max-shard-size", "2 GB-ish"], "--max-shard-size"),
             ([*out, "--flavor", "no-such-model"], "unknown model"),
             ([*out, "--flavor", "gpt-oss-20b-shape"], "GQA family"),
             ([*out, "--flavor", "small"], "has shape")]            # .metadata against the model: no data read
    for argv, needle in cases:
        code, err = _export(["--checkpoint", step, *argv])
        assert code == 2 and needle in err, (argv, err)
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        main(["export", "--checkpoint", step, *out, "--dtype", "float8"])
    assert not os.path.exists(tmp_path / "hf")


def _with_large_weight(args, seed: int, value: float):
    model = random_model(args, fresh_seed(seed))
    with torch.no_grad():
        model.layers[str(args.n_layers - 1)].attention.wo.weight[2, 1] = value   # in the last files
    return model


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_float16_refuses_a_weight_above_its_range_and_leaves_out_as_it_was(tmp_path, monkeypatch):
    import safetensors.torch

    args = debug_args()
    _, _, step = _run(tmp_path, 203, _with_large_weight(args, 203, -7.0e4))
    out = tmp_path / "hf"
    out.mkdir()                                                  # an empty --out stays, empty
    before = _listing(tmp_path)
    written, save = [], safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", lambda d, p, **kw: (written.append(p), save(d, p, **kw)))
    wo = f"model.layers.{args.n_layers - 1}.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=rf"--dtype float16: {wo} .* up to 70000, above float16's largest 65504"
                                         r".*--dtype bfloat16 or float32"):
        export_checkpoint(step, str(out), args, dtype=torch.float16, max_shard_bytes=100_000)
    assert len(written) > 1                                      # files were written before the refusal
    assert _listing(out) == [] and _listing(tmp_path) == before
    code, err = _export(["--checkpoint", step, "--out", str(out), "--dtype", "float16"])
    assert code == 2 and wo in err and _listing(out) == []
    assert _export(["--checkpoint", step, "--out", str(out), "--dtype", "bfloat16"])[0] == 0   # the same --out
    assert "config.json" in _listing(out) and _listing(tmp_path) == before
    assert stat.S_IMODE(os.stat(out).st_mode) & 0o755 == 0o755   # a folder's usual mode, not mkdtemp's 0700


def test_float16_keeps_its_largest_value_and_a_stored_inf_is_left_to_the_import(tmp_path):
    from safetensors.torch import load_file

    args = debug_args()
    for name, value in (("edge", 65504.0), ("inf", float("inf"))):
        step = save_dcp(_with_large_weight(args, 204, value), str(tmp_path / name / "step-1"))
        out = tmp_path / name / "hf"
        report = export_checkpoint(step, str(out), args, dtype=torch.float16)
        wo = load_file(str(out / report.files[0]))[f"model.layers.{args.n_layers - 1}.self_attn.o_proj.weight"]
        assert wo[2, 1].item() == value


def test_a_failure_while_writing_leaves_out_and_its_parents_as_they_were(tmp_path, monkeypatch):
    import safetensors.torch

    args, _, step = _run(tmp_path, 205)
    save, calls = safetensors.torch.save_file, []

    def disk_full(data, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)                             # half a file, then ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device", path)
        save(data, path, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    before = _listing(tmp_path)
    out = tmp_path / "new" / "deeper" / "hf"                     # its parents are created, then removed
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(step, str(out), args, max_shard_bytes=100_000)
    assert _listing(tmp_path) == before
    with pytest.raises(OSError, match="No space left"):
        calls.clear()
        export_checkpoint(step, str(tmp_path / "hf"), args, max_shard_bytes=100_000)
    assert _listing(tmp_path) == before
    monkeypatch.setattr(safetensors.torch, "save_file", save)
    report = export_checkpoint(step, str(out), args, max_shard_bytes=100_000)
    assert _listing(out) == sorted(report.files + ["config.json", "model.safetensors.index.json"])


def _with_mtp_layer(args, out) -> list[str]:
    """`out` given DeepSeek-V3's MTP layer: config num_nextn_predict_layers = 1, model.layers.{L}.* tensors."""
    from safetensors.torch import save_file

    layer = f"model.layers.{args.n_layers}"
    H = args.dim
    extra = {f"{layer}.eh_proj.weight": torch.randn(H, 2 * H), f"{layer}.enorm.weight": torch.ones(H),
             f"{layer}.hnorm.weight": torch.ones(H), f"{layer}.input_layernorm.weight": torch.ones(H)}
    save_file(extra, os.path.join(out, "model-mtp.safetensors"))
    for name, change in (("config.json", lambda c: c.update(num_nextn_predict_layers=1)),
                         ("model.safetensors.index.json",
                          lambda c: c["weight_map"].update({n: "model-mtp.safetensors" for n in extra}))):
        with open(os.path.join(out, name)) as f:
            body = json.load(f)
        change(body)
        with open(os.path.join(out, name), "w") as f:
            json.dump(body, f)
    return list(extra)


def test_import_names_the_mtp_layers_it_does_not_load(tmp_path, monkeypatch):
    from mop_train.hf import load

    args = debug_args()
    model = random_model(args, fresh_seed(206))
    out = str(tmp_path / "hf")
    export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args)
    assert load.load_hf_state_dict(random_model(args, 0).state_dict(), out, args).note is None
    extra = _with_mtp_layer(args, out)
    target = random_model(args, 0)
    state = target.state_dict()
    report = load.load_hf_state_dict(state, out, args)
    assert (f"num_nextn_predict_layers = 1: its multi-token-prediction layer model.layers.{args.n_layers} "
            f"({len(extra)} tensors) is not loaded") in report.note, report.note
    assert "no place for" not in report.note
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key

    class Wrapper:                                               # torchtitan's ModelWrapper, as load_hf_weights uses it
        def __init__(self, m):
            self.model = [m]

        def load_state_dict(self, sd):
            self.model[0].load_state_dict(sd)

    lines = []
    monkeypatch.setattr(load.logger, "warning", lines.append)
    load.load_hf_weights(Wrapper(target), target.state_dict(), out)
    assert lines == [report.note]                                # one line (this process is rank 0)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = "one"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 'one' is not a count"):
        load.load_hf_state_dict(random_model(args, 0).state_dict(), out, args)
