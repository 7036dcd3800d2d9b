"""TOML + CLI parsing of the merged JobConfig and every bad-input case."""

import pytest
import torch

from mop_train.config import load_job_config
from mop_train.units import parse_bytes


def _write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_toml_and_cli_override(tmp_path):
    path = _write(tmp_path, '[training]\nseq_len = 64\n[mop.layout]\nseq_degree = 2\n'
                            '[mop.moe]\ndispatch = "pipelined_llep"\ntoken_budget = 512\n')
    cfg = load_job_config(["--job.config_file", path, "--mop.layout.expert_degree", "4",
                           "--mop.moe.max_chunks", "3"])
    assert cfg.training.seq_len == 64
    assert cfg.mop.layout.seq_degree == 2 and cfg.mop.layout.expert_degree == 4
    assert cfg.mop.moe.dispatch == "pipelined_llep" and cfg.mop.moe.token_budget == 512
    assert cfg.mop.moe.max_chunks == 3
    cfg = load_job_config([f"--job.config_file={path}", "--mop.layout.seq_degree=8"])
    assert cfg.mop.layout.seq_degree == 8
    path = _write(tmp_path, '[mop.tiling]\nffn_tokens = 4096\nblock_tokens = "auto"\n', name="tiles.toml")
    cfg = load_job_config(["--job.config_file", path, "--mop.tiling.ffn_tokens", "auto"])
    assert cfg.mop.tiling.ffn_tokens == "auto" and cfg.mop.tiling.block_tokens == "auto"
    cfg = load_job_config(["--job.config_file", path])
    assert cfg.mop.tiling.ffn_tokens == 4096


def test_defaults_without_file():
    cfg = load_job_config([])
    assert cfg.mop.layout.seq_degree == 1 and cfg.mop.moe.dispatch == "local"


BAD_KEYS_OR_TYPES = [
    ("[mop.layout]\nseq_degre = 2\n", ["mop.layout.seq_degre", "seq_degree", "unknown key"]),
    ("[mop.lay]\nseq_degree = 2\n", ["mop.lay", "layout"]),
    ("[trainin]\nsteps = 2\n", ["trainin", "training"]),
    ("[mop.layout]\nseq_degree = \"two\"\n", ["mop.layout.seq_degree", "'two'", "int"]),
    ("[mop.moe]\ndispatch = \"fast\"\n", ["mop.moe.dispatch", "'fast'", "'pipelined_llep'"]),
    ("[mop.moe]\nalpha = true\n", ["mop.moe.alpha", "True", "float"]),
    ("[mop]\nlayout = 3\n", ["mop.layout", "table"]),
    ("[mop.tiling]\nffn_tokens = \"sometimes\"\n", ["mop.tiling.ffn_tokens", "'sometimes'", "'auto'"]),
    ("[mop.tiling]\nblock_tokens = 1.5\n", ["mop.tiling.block_tokens", "1.5", "int"]),
]
IMPOSSIBLE_VALUES = [
    ("[mop.layout]\nseq_degree = 0\n", ["mop.layout.seq_degree = 0", ">= 1"]),
    ("[mop.moe]\ntoken_budget = 0\n", ["mop.moe.token_budget = 0"]),
    ("[mop.moe]\nimbalance_threshold = 0.5\n", ["imbalance_threshold = 0.5", ">= 1.0"]),
    ("[mop.sco]\nhost_budget = \"lots\"\n", ["mop.sco.host_budget", "'lots'", "24GiB"]),
    ("[mop.offload_adamw]\nslots = 0\n", ["mop.offload_adamw.slots = 0"]),
    ("[mop.offload_adamw]\nhost_fraction = 1.5\n", ["mop.offload_adamw.host_fraction = 1.5", "[0, 1]"]),
    ("[mop.offload_adamw]\nhost_fraction = 0.4\n", ["host_fraction = 0.4", "OffloadStreamAdamW", "'AdamW'"]),
    ("[mop.layout]\nexpert_degree = 2\n", ["dispatch = 'local'", "expert_degree = 2"]),
    ("[mop.offload_adamw]\nweights = \"bf16\"\n", ["mop.offload_adamw.weights = 'bf16'", "optimizer.name = 'OffloadStreamAdamW'"]),
    ("[mop.offload_adamw]\ngradients = \"stream\"\n", ["mop.offload_adamw.gradients = 'stream'", "OffloadStreamAdamW"]),
    ("[optimizer]\nname = \"OffloadStreamAdamW\"\n[training]\nmixed_precision_param = \"float32\"\n[mop.offload_adamw]\nweights = \"bf16\"\n",
     ["weights = 'bf16'", "mixed_precision_param = 'float32'", "bfloat16", "weights = 'stream'"]),
    ("[optimizer]\nname = \"OffloadStreamAdamW\"\n[parallelism]\nfsdp_reshard_after_forward = \"never\"\n"
     "[mop.offload_adamw]\nweights = \"stream\"\n",
     ["fsdp_reshard_after_forward = 'never'", "weights = 'stream'", "'default'", "'bf16'"]),
    ("[optimizer]\nname = \"OffloadStreamAdamW\"\n[mop.offload_adamw]\nweight_window = 0\n", ["mop.offload_adamw.weight_window = 0", ">= 1"]),
    ("[optimizer]\nname = \"OffloadStreamAdamW\"\n[mop.moe]\ndispatch = \"ep\"\n[activation_checkpoint]\nmode = \"none\"\n[mop.offload_adamw]\nweights = \"stream\"\n",
     ["weights = 'stream'", "activation_checkpoint.mode = 'none'", "dispatch = 'ep'", "\"full\""]),
    ("[mop.data]\nloss_chunk_tokens = 0\n", ["mop.data.loss_chunk_tokens = 0"]),
    ("[mop.tiling]\nffn_tokens = -4\n", ["mop.tiling.ffn_tokens = -4", "\"auto\""]),
    ("[mop.offload_adamw]\nstage_in_backward = true\n", ["mop.offload_adamw.stage_in_backward = true",
                                                        "OffloadStreamAdamW", "'AdamW'"]),
]


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ValueError, match="config file not found: .*nope.toml"):
        load_job_config(["--job.config_file", str(tmp_path / "nope.toml")])
    path = _write(tmp_path, "[training\nsteps = 1\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_job_config(["--job.config_file", path])


def test_cli_wrong_type_is_rejected(tmp_path):
    with pytest.raises(SystemExit):
        load_job_config(["--mop.layout.seq_degree", "two"])


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("0") == 0 and parse_bytes(7) == 7
    assert parse_bytes("1.5 KiB") == 1536
    for bad in ("-1GiB", "GiB", "12 parsecs", -3, "inf", "nan", "1e400GiB"):   # (inf raised OverflowError)
        with pytest.raises(ValueError, match="byte size|must be >= 0"):
            parse_bytes(bad)


UNHONOURED = [
    ("[fault_tolerance]\nenable = true\n", ["fault_tolerance.enable = True", "no key of [fault_tolerance] is implemented"]),
    ("[validation]\nenable = true\n", ["validation.dataset = 'c4_validation'", "\"embedded\""]),
    ("[validation]\nenable = true\ndataset = \"embedded\"\nsteps = 0\n", ["validation steps must be positive or -1"]),
    ("[validation]\nenable = true\ndataset = \"foo\"\n", ["validation.dataset = 'foo'", "embedded, jsonl"]),
    ("[validation]\nenable = true\ndataset = \"embedded\"\nseq_len = 130\n[mop.layout]\nseq_degree = 4\n",
     ["validation.seq_len = 130", "seq_degree = 4", "validation.seq_len = 128"]),
    ("[validation]\nenable = true\ndataset = \"embedded\"\nfreq = 50\n[training]\nsteps = 20\n",
     ["validation.freq = 50", "training.steps = 20", "no validation would run"]),
    ("[training.dataloader]\nnum_workers = 2\n", ["training.dataloader.num_workers = 2", "2 times", "= 0"]),
    ("[profiling]\nenable_profiling = true\nprofile_freq = 3\n", ["profiling.profile_freq = 3", "= 4"]),
    ("[compile]\nenable = true\ncomponents = [\"model\", \"vae\"]\n", ["compile.components", "'vae'"]),
    ("[model]\nname = \"llama9\"\n", ["model.name = 'llama9'", "'mop'"]),
    ("[training]\ngc_freq = 7\n", ["training.gc_freq = 7", "honoured keys in [training]", "seq_len"]),
    ("[parallelism]\ndata_parallel_shard_degree = 2\n", ["parallelism.data_parallel_shard_degree = 2", "-1"]),
    ("[checkpoint]\nasync_mode = \"async\"\n", ["checkpoint.async_mode = 'async'", "'disabled'"]),
    ("[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n", ["quantize.linear", "no key of [quantize]"]),
    ("[job]\ncustom_config_module = \"os\"\n", ["job.custom_config_module", "not accepted"]),
    ("[mop.reliability]\nmax_consecutive_skips = 0\n", ["mop.reliability.max_consecutive_skips = 0", ">= 1"]),
    ("[mop.metrics]\npeak_tflops = -790.0\n", ["mop.metrics.peak_tflops = -790.0", ">= 0", "datasheet"]),
]


@pytest.mark.parametrize("text, needles", BAD_KEYS_OR_TYPES + IMPOSSIBLE_VALUES + UNHONOURED)
def test_bad_input_names_key_value_file_and_fix(tmp_path, text, needles):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_job_config(["--job.config_file", path])
    msg = str(info.value)
    assert path in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from: {msg}"


def test_command_line_values_name_the_flag_and_the_file(tmp_path):
    path = _write(tmp_path, "[model]\nflavor = \"debug\"\n")
    for argv, needles in ((["--fault_tolerance.enable"], ["--fault_tolerance.enable", "fault_tolerance.enable = True"]),
                          (["--model.flavor", "gigantic"], ["--model.flavor", "'gigantic'", "debug, small"]),
                          (["--job.custom_config_module", "os"], ["command line", "not accepted"])):
        with pytest.raises(ValueError) as info:
            load_job_config(["--job.config_file", path, *argv], model_flavors=["debug", "small"])
        for needle in needles:
            assert needle in str(info.value), f"{needle!r} missing from: {info.value}"
    assert load_job_config(["--job.config_file", path], model_flavors=["debug"]).model.name == "mop"


def test_initial_load_in_hf_is_honoured_and_checked(tmp_path):
    """torchtitan's HF-initial-load keys are read (mop_train.hf.load); the combinations torchtitan would
    ignore or assert on are refused before launch, naming the key."""
    cfg = load_job_config(["--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path),
                           "--checkpoint.initial_load_in_hf"])
    assert cfg.checkpoint.initial_load_in_hf and cfg.checkpoint.initial_load_path == str(tmp_path)
    for argv, needle in ((["--checkpoint.enable", "--checkpoint.initial_load_in_hf"], "needs checkpoint.initial_load_path"),
                         (["--checkpoint.initial_load_path", str(tmp_path)], "checkpoint.enable = true"),
                         (["--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path),
                           "--checkpoint.initial_load_in_hf", "--checkpoint.no-initial_load_model_only"],
                          "initial_load_model_only = true"),
                         (["--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path),
                           "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_in_hf_quantized"],
                          "checkpoint.initial_load_in_hf_quantized")):
        with pytest.raises(ValueError, match=needle):
            load_job_config(argv)


def test_mfu_peak_is_the_configured_one_else_the_datasheet(tmp_path, monkeypatch):
    from mop_train.train.metrics import PEAK_BF16_TFLOPS, peak_tflops
    path = _write(tmp_path, "[mop.metrics]\npeak_tflops = 790.0\n")
    assert load_job_config(["--job.config_file", path]).mop.metrics.peak_tflops == 790.0
    assert load_job_config([]).mop.metrics.peak_tflops == 0.0
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_tflops(cuda) == PEAK_BF16_TFLOPS["H200"] and peak_tflops(cuda, 790.0) == 790.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_tflops(cuda) is None and peak_tflops(cuda, 1234.5) == 1234.5
    assert peak_tflops(torch.device("cpu"), 790.0) is None  # no MFU without a GPU
