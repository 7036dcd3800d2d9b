"""`mop-train`: inspection commands that need no GPU and no process group, and a launcher.

    mop-train layout --world 64 --seq 8 --expert 64 --vocab 8   # print the MoP rank layout
    mop-train zoo                                               # the named models and their sizes
    mop-train train --standalone --nproc-per-node 8 configs/x.toml --training.steps 100   # check, then torchrun
    mop-train plan --world 64 --gpu-memory 141GiB --host-memory 2TiB configs/x.toml   # will it fit?
    mop-train plan --auto --objective context --world 64 --gpu-memory 141GiB --host-memory 2TiB configs/x.toml
    mop-train export --checkpoint outputs/x/checkpoint/step-200 --out hf/x --dtype bfloat16   # -> Hugging Face

`train` and `plan` take the job's TOML as a positional path or as `--job.config_file X.toml`
(torchtitan's spelling), anywhere among their own options; `--section.key` overrides follow.

`plan --auto` chooses the layout degrees and operator settings (mop_train.plan.auto) for the
longest context or the most tokens/s at one context, keeping the keys given as overrides, and prints
them with their plan (exit 1 with the closest configuration when nothing fits).

`export` writes a Hugging Face DeepseekV3 folder (config.json, safetensors shards and index, the
run's tokenizer) from a checkpoint of the MLA family, on CPU (mop_train.hf.export).

`train` checks the configuration in this process first (a bad key or value: one line, exit 2,
before any rank starts; the layout degrees against W = nproc-per-node x nnodes), then runs
torchrun's launcher in-process on this node and exits with the ranks' own exit code
(mop_train.train.__main__ lists them) instead of torchrun's summary and its exit 1; on SIGTERM or
SIGINT it passes the signal to the ranks, which stop at a step boundary and save, and exits 5.
Several nodes: the same command on each, with torchrun's flags passed through to its launcher:
    mop-train train --nnodes 4 --node-rank R --rdzv-endpoint HOST:29400 --nproc-per-node 8 configs/x.toml
"""

from __future__ import annotations

import argparse
import os
import sys


def _layout(args: argparse.Namespace) -> int:
    from mop_train.layout import plan_layout

    print(plan_layout(args.world, args.seq, args.expert, args.vocab).describe())
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from mop_train.models import zoo

    print(zoo.format_table())
    return 0


LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                "--standalone")
"""`mop-train train`'s own flags: torchrun's launcher flags, passed through to its launcher."""


def _node_range(nnodes: str) -> tuple[int, int]:
    """(MIN, MAX) of torchrun's --nnodes N or MIN:MAX."""
    try:
        low, _, high = nnodes.partition(":")
        low_n, high_n = int(low), int(high or low)
    except ValueError:
        low_n = high_n = 0
    if not 1 <= low_n <= high_n:
        raise ValueError(f"--nnodes {nnodes!r} must be N or MIN:MAX with 1 <= MIN <= MAX (torchrun's form)")
    return low_n, high_n


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """torchrun's launcher flags for `mop-train train`'s: one node alone (--standalone, the default
    when no --rdzv-endpoint is given), or one of --nnodes nodes meeting at --rdzv-endpoint
    (backend c10d unless --rdzv-backend says otherwise), as torchrun takes them."""
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node} must be >= 1")
    _, nodes = _node_range(args.nnodes)
    flags = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint is None:
        if nodes > 1:
            raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node; "
                             f"backend c10d) and a distinct --node-rank per node, or --rdzv-id for c10d")
        if args.rdzv_backend not in (None, "c10d") or args.rdzv_id is not None or args.node_rank not in (None, 0):
            raise ValueError("--rdzv-backend, --rdzv-id and --node-rank need --rdzv-endpoint (without it the "
                             "launch is one node alone, torchrun's --standalone)")
        return [*flags, "--standalone"]
    if args.standalone:
        raise ValueError(f"--standalone and --rdzv-endpoint {args.rdzv_endpoint} are alternatives: --standalone "
                         f"meets on this host alone; drop one")
    flags += [f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-backend={args.rdzv_backend or 'c10d'}"]
    if args.rdzv_id is not None:
        flags.append(f"--rdzv-id={args.rdzv_id}")
    if args.node_rank is not None:
        flags.append(f"--node-rank={args.node_rank}")
    return flags


def _train(args: argparse.Namespace) -> int:
    import logging

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.parallel.fake_world import COMM_MODE as FAKE_MODE

    from torchtitan.tools.logging import logger

    logger.setLevel("ERROR")   # torchtitan warns that hf_assets_path = "embedded" is not a folder
    own = [a for a in args.overrides if a.split("=")[0].replace("_", "-") in LAUNCH_FLAGS]
    if own:
        raise ValueError(f"{own[0].split('=')[0]} is an option of `mop-train train`: put it before the config file "
                         f"({args.config}); what follows the config file are --section.key overrides")
    launcher = torchrun_args(args)
    job = _job_argv(args)
    low, high = _node_range(args.nnodes)
    world = args.nproc_per_node * low if low == high else None   # elastic: W known only at the rendezvous
    if load_job_config(job, model_flavors=zoo.names()).comm.mode == FAKE_MODE:   # before its layout meets W
        raise ValueError(f"comm.mode = {FAKE_MODE!r} runs one rank of a W-rank job in one process, not under "
                         f"`mop-train train` (torchrun's launcher); start it with plain python: "
                         f"WORLD_SIZE=W RANK=r python -m mop_train.train --job.config_file {args.config} ...")
    cfg = load_job_config(job, model_flavors=zoo.names(), world_size=world)   # ValueError -> one line, exit 2
    if world is not None:   # the ranks' first checks, here before any rank starts (config_checks.check_launch)
        from mop_train.config_checks import check_launch
        check_launch(cfg, world, zoo.get_model_args(cfg.model.flavor), source=args.config)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from mop_train.train.reliability import EXIT_STOPPED

    launch = torchrun.parse_args([*launcher, "-m", "mop_train.train", *job])
    for name in list(logging.root.manager.loggerDict):  # the ranks say what went wrong, not the agent
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(launch)
    except ChildFailedError as err:
        codes = [f.exitcode for _, f in sorted(err.failures.items())]
        return next((c for c in codes if c > 0), 1)  # a rank's own code, not a kill by the launcher
    except SignalException:
        # torchrun's agent passed the signal on to the ranks and waited for them (30 s, then
        # SIGKILL): they stopped at a step boundary and saved, as their own messages say.
        return EXIT_STOPPED
    return 0


def _plan(args: argparse.Namespace) -> int:
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.report import plan_job

    from torchtitan.tools.logging import logger

    logger.setLevel("ERROR")
    own = [a for a in args.overrides if a.startswith("--") and "." not in a.split("=")[0]]
    if own:
        raise ValueError(f"{own[0].split('=')[0]} is an option of `mop-train plan`: put it before the config file "
                         f"({args.config}) and the first --section.key override; what follows them are overrides")
    if not args.auto and (args.objective or args.seq_len or args.headroom):
        raise ValueError("--objective, --seq-len and --headroom belong to the search: add --auto")
    job = _job_argv(args)
    if args.auto:   # the config's values of searched keys must not make the given ones invalid
        from mop_train.plan.settings import fixed_keys, search_base_flags
        job[2:2] = search_base_flags(fixed_keys(args.overrides))
    # Without --auto the layout is the job's: its degrees against --world named by key and origin, as `train`
    # does (plan_layout's own words named neither the key, the file nor --world). The search replaces them.
    world = args.world if args.world >= 1 and not args.auto else None
    cfg = load_job_config(job, model_flavors=zoo.names(), world_size=world)
    gpu_bytes = _memory_arg(args.gpu_memory, "--gpu-memory", "80GiB") if args.gpu_memory else None
    host_bytes = _memory_arg(args.host_memory, "--host-memory", "2TiB") if args.host_memory else None
    if args.world < 1:
        raise ValueError(f"--world {args.world} must be >= 1 (the job's total ranks)")
    # (`or` took --ranks-per-node 0 as unset and planned min(W, 8) ranks per node instead)
    ranks_per_node = min(args.world, 8) if args.ranks_per_node is None else args.ranks_per_node
    if args.world >= 1 and (ranks_per_node < 1 or args.world % ranks_per_node):
        given = "--ranks-per-node" if args.ranks_per_node is not None else "the default --ranks-per-node (min(W, 8))"
        fits = [r for r in range(1, min(args.world, 8) + 1) if args.world % r == 0]
        raise ValueError(f"{given} = {ranks_per_node} must divide --world = {args.world} (every node runs the same "
                         f"number of ranks); pass --ranks-per-node as one of {fits} (or a larger divisor)")
    if args.auto:
        return _plan_auto(args, cfg, job, gpu_bytes=gpu_bytes, host_bytes=host_bytes, ranks_per_node=ranks_per_node)
    from mop_train.config_checks import check_context_fits_model
    check_context_fits_model(cfg.training.seq_len, zoo.get_model_args(cfg.model.flavor), cfg.model.flavor)
    text, fits = plan_job(cfg, world=args.world, ranks_per_node=ranks_per_node, gpu_bytes=gpu_bytes,
                          host_bytes=host_bytes)
    print(text)
    return 0 if fits else 1


def _memory_arg(text: str, key: str, example: str) -> int:
    """--gpu-memory / --host-memory: a size with a unit, above zero. A bare number was taken as bytes
    ("--gpu-memory 80": 80 bytes, "0.0 GiB per rank: DOES NOT FIT", exit 1), and 0 planned against
    nothing, both read as "the job does not fit" rather than as the typo they are."""
    from mop_train.units import names_a_unit, parse_bytes

    size = parse_bytes(text, key=key)
    per = "GPU" if "gpu" in key else "node"
    if size == 0:
        raise ValueError(f"{key} {text!r} is zero: nothing can be planned against it; give the memory per {per}, "
                         f"e.g. {key} {example}")
    if not names_a_unit(text):
        raise ValueError(f"{key} {text!r} has no unit, so it would be {size:,} bytes per {per}; write the unit: "
                         f"{key} {text}GiB (binary) or {key} {text}GB (decimal)")
    return size


def _job_argv(args: argparse.Namespace) -> list[str]:
    """torchtitan's argv for the job: the config file, then the overrides."""
    if args.config is None:
        raise ValueError(f"`mop-train {args.command}` needs the job's TOML: a path, or --job.config_file X.toml")
    if args.overrides and not args.overrides[0].startswith("--"):
        raise ValueError(f"unexpected {args.overrides[0]!r} after the config file {args.config}: give the config once "
                         f"(a path or --job.config_file) and --section.key overrides after it")
    return ["--job.config_file", args.config, *args.overrides]


CONFIG_FLAGS = ("--job.config_file", "--job.config-file")


def config_flag_as_path(argv: list[str]) -> list[str]:
    """`train`/`plan` argv with `--job.config_file X` turned into the positional path X, placed after
    the subcommand's own options (before the first --section.key override), where argparse wants it."""
    if len(argv) < 2 or argv[0] not in ("train", "plan"):
        return argv
    rest, path = [], None
    i = 1
    while i < len(argv):
        flag, _, value = argv[i].partition("=")
        if flag in CONFIG_FLAGS:
            if path is not None:
                raise ValueError(f"{flag} is given twice ({path!r} and {value or argv[i + 1:i + 2]!r}); give it once")
            if not value and i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value: the job's TOML file")
            path, i = (value, i + 1) if value else (argv[i + 1], i + 2)
            continue
        rest.append(argv[i])
        i += 1
    if path is None:
        return argv
    first_override = next((j for j, a in enumerate(rest) if a.startswith("--") and "." in a.split("=")[0]), len(rest))
    return [argv[0], *rest[:first_override], path, *rest[first_override:]]


def _export(args: argparse.Namespace) -> int:
    """Every argument check that reads no tensor data, then the manifest check (a read of every file),
    then the export."""
    from mop_train.hf.dcp_chunks import check_step_folder
    from mop_train.hf.export import DTYPES, export_checkpoint
    from mop_train.hf.run_record import find_run_record
    from mop_train.models import zoo
    from mop_train.units import names_a_unit, parse_bytes

    check_step_folder(args.checkpoint)          # before the run record: a wrong folder has none above it
    max_shard_bytes = parse_bytes(args.max_shard_size, key="--max-shard-size")
    # (0 or a bare "2" wrote one safetensors file per tensor, silently: 85 files for `debug`)
    if max_shard_bytes == 0 or not names_a_unit(args.max_shard_size):
        raise ValueError(f"--max-shard-size {args.max_shard_size!r} must be a size above zero with its unit, e.g. "
                         f"--max-shard-size 2GiB (bytes per safetensors file)")
    record = find_run_record(args.checkpoint)
    if args.flavor is not None:
        model_args = zoo.get_model_args(args.flavor)
    elif record is not None:
        model_args = record.args
    else:
        raise ValueError(f"no mop_model.json of the run above {args.checkpoint} (written at launch into the run's "
                         f"job.dump_folder); pass --flavor, the run's model.flavor")
    tokenizer = args.tokenizer or (record.tokenizer_folder if record is not None else None)
    report = export_checkpoint(args.checkpoint, args.out, model_args, dtype=DTYPES.get(args.dtype),
                               max_shard_bytes=max_shard_bytes,
                               tokenizer_folder=None if tokenizer == "none" else tokenizer,
                               verify=None if args.no_verify else _verify_checkpoint)
    print(f"wrote {args.out}: config.json, {len(report.files)} safetensors file(s) with "
          f"model.safetensors.index.json ({report.total_bytes / 2**20:.1f} MiB of tensors; at most "
          f"{report.peak_bytes / 2**20:.1f} MiB held at once)"
          + (f", tokenizer {', '.join(report.tokenizer_files)}" if report.tokenizer_files else ", no tokenizer")
          + (f"; model from {record.path}" if record is not None and args.flavor is None else ""))
    return 0


def _plan_auto(args, cfg, job: list[str], *, gpu_bytes, host_bytes, ranks_per_node: int) -> int:
    """`plan --auto`: search, print the chosen overrides and plan; 1 with the numbers when nothing fits."""
    import dataclasses

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.auto import AutoPlanner, NothingFits, format_result
    from mop_train.plan.settings import fixed_keys
    from mop_train.units import parse_bytes

    if gpu_bytes is None or host_bytes is None:
        raise ValueError("--auto needs --gpu-memory (per GPU, e.g. 141GiB) and --host-memory (per node, e.g. "
                         "2TiB): the search sizes every operator against them")
    objective = args.objective or "throughput"
    fixed = fixed_keys(args.overrides)
    if objective == "context" and (args.seq_len or "training.seq_len" in fixed):
        raise ValueError("--objective context searches training.seq_len; drop --seq-len / --training.seq_len, "
                         "or use --objective throughput to rank configurations at one context")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len {args.seq_len} must be >= 1 (tokens per sequence)")
    _check_fixed_layout(args, cfg, fixed, objective)
    if objective == "throughput":
        from mop_train.config_checks import check_context_fits_model
        check_context_fits_model(args.seq_len or cfg.training.seq_len, zoo.get_model_args(cfg.model.flavor),
                                 cfg.model.flavor, key="--seq-len" if args.seq_len else "training.seq_len")
    if args.seq_len is not None:
        if "training.seq_len" in fixed and cfg.training.seq_len != args.seq_len:
            raise ValueError(f"--seq-len {args.seq_len} and --training.seq_len {cfg.training.seq_len} disagree; "
                             "give one")
        cfg.training = dataclasses.replace(cfg.training, seq_len=args.seq_len)
    planner = AutoPlanner(cfg, fixed=fixed, world=args.world, ranks_per_node=ranks_per_node, gpu_bytes=gpu_bytes,
                          host_bytes=host_bytes, headroom=parse_bytes(args.headroom or "2GiB", key="--headroom"))
    try:
        result = planner.longest_context() if objective == "context" else planner.fastest_at(cfg.training.seq_len)
    except NothingFits as err:
        print(f"mop-train plan --auto: {err}")
        return 1
    load_job_config(job + result.chosen.settings.flags(cfg), model_flavors=zoo.names())  # the flags parse and check
    print(format_result(planner, result))
    return 0


def _check_fixed_layout(args, cfg, fixed: set[str], objective: str) -> None:
    """Layout degrees given as overrides must fit the model and the context before a search: the search
    keeps them, and when none of its layouts was valid it said only "nothing fits ...: no layout of the
    searched degrees is valid for this model" (exit 1, as if memory were short), naming neither the key
    nor the value (`--training.seq_len 4097 --mop.layout.seq_degree 2`)."""
    import dataclasses

    from mop_train.layout import plan_layout
    from mop_train.models import zoo
    from mop_train.parallel.parallelize import check_layout_fits

    names = ("seq_degree", "expert_degree", "vocab_degree")
    if not any(f"mop.layout.{n}" in fixed for n in names):
        return
    lay = cfg.mop.layout
    D, E, P = (getattr(lay, n) if f"mop.layout.{n}" in fixed else 1 for n in names)
    seq = (args.seq_len or cfg.training.seq_len) if objective == "throughput" else D   # context: searched
    check_layout_fits(plan_layout(args.world, D, E, P), dataclasses.replace(cfg.training, seq_len=seq),
                      zoo.get_model_args(cfg.model.flavor))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mop-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    lay = sub.add_parser("layout", help="print the MoP rank layout for a world size and three degrees")
    lay.add_argument("--world", type=int, required=True, help="W: total ranks")
    lay.add_argument("--seq", type=int, default=1, help="D: sequence-group degree")
    lay.add_argument("--expert", type=int, default=1, help="E_p: expert-group degree")
    lay.add_argument("--vocab", type=int, default=1, help="P: vocab-group degree")
    lay.set_defaults(func=_layout)
    zoo = sub.add_parser("zoo", help="list the named model configs with exact parameter counts")
    zoo.set_defaults(func=_zoo)
    train = sub.add_parser("train", help="check a job's configuration, then train on this node's ranks "
                                          "(torchrun's launcher, in process)")
    train.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                       help="ranks on this node (torchrun's)")
    train.add_argument("--nnodes", default="1", help="nodes: N or MIN:MAX (torchrun's; > 1 needs --rdzv-endpoint)")
    train.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's rank (torchrun's)")
    train.add_argument("--rdzv-backend", "--rdzv_backend", default=None,
                       help="rendezvous backend with --rdzv-endpoint (torchrun's; default c10d)")
    train.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                       help="HOST:PORT where the nodes meet (torchrun's); without it: one node alone")
    train.add_argument("--rdzv-id", "--rdzv_id", default=None, help="the job's rendezvous id (torchrun's)")
    train.add_argument("--standalone", action="store_true",
                       help="one node alone on this host (torchrun's; the default without --rdzv-endpoint)")
    train.add_argument("config", nargs="?", help="the job's TOML file (or --job.config_file X.toml)")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="torchtitan-style flags: --section.key value")
    train.set_defaults(func=_train)
    plan = sub.add_parser("plan", help="print a job's per-rank device and host memory plan; exit 1 if it does not fit")
    plan.add_argument("--world", type=int, default=1, help="W: total ranks (default 1)")
    plan.add_argument("--ranks-per-node", "--ranks_per_node", type=int, default=None,
                      help="ranks sharing a host (default min(W, 8))")
    plan.add_argument("--gpu-memory", "--gpu_memory", default=None, help="device bytes per rank, e.g. 141GiB")
    plan.add_argument("--host-memory", "--host_memory", default=None,
                      help="host bytes per node, e.g. 2TiB (also sizes SCO's \"auto\")")
    plan.add_argument("--auto", action="store_true",
                      help="search the degrees and operator settings; print the chosen overrides and their plan "
                           "(keys given as overrides are kept)")
    plan.add_argument("--objective", choices=("context", "throughput"), default=None,
                      help="with --auto: the longest context that fits, or the most tokens/s at one context "
                           "(default throughput)")
    plan.add_argument("--seq-len", "--seq_len", type=int, default=None,
                      help="with --auto --objective throughput: the context (default the config's training.seq_len)")
    plan.add_argument("--headroom", default=None,
                      help="with --auto: device bytes per GPU the plan may not use (default 2GiB)")
    plan.add_argument("config", nargs="?", help="the job's TOML file (or --job.config_file X.toml)")
    plan.add_argument("overrides", nargs=argparse.REMAINDER, help="torchtitan-style flags: --section.key value")
    plan.set_defaults(func=_plan)
    _add_export(sub)
    return parser


def _add_export(sub) -> None:
    exp = sub.add_parser("export", help="write a Hugging Face DeepseekV3 folder from a checkpoint of the MLA family "
                                        "(CPU)")
    exp.add_argument("--checkpoint", required=True, help="a checkpoint step folder, DUMP/checkpoint/step-N")
    exp.add_argument("--out", required=True, help="a new folder: config.json, model-*.safetensors, their index, "
                                                  "the tokenizer files")
    exp.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                     help="tensor dtype (default: the checkpoint's); the router's gate and bias stay float32")
    exp.add_argument("--max-shard-size", default="2GiB",
                     help="bytes per safetensors file (default 2GiB); bounds the host memory the export holds")
    exp.add_argument("--flavor", default=None,
                     help="the run's model.flavor (default: the run's mop_model.json, in its dump folder)")
    exp.add_argument("--tokenizer", default=None,
                     help="folder whose tokenizer files to copy, or 'none' (default: the run's, from mop_model.json)")
    exp.add_argument("--no-verify", action="store_true",
                     help="skip checking the checkpoint's files against its manifest (one extra read of each)")
    exp.set_defaults(func=_export)


def _check_config_file(args: argparse.Namespace) -> None:
    """The positional CONFIG of `train` and `plan` must name a file (said in their own words)."""
    config = getattr(args, "config", None)
    if config is not None and not os.path.isfile(config):
        raise ValueError(f"config file not found: {config!r}; give an existing TOML file as the CONFIG argument "
                         f"of `mop-train {args.command}` (see configs/ for examples)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = config_flag_as_path(argv)
    except ValueError as err:
        print(f"mop-train {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        _check_config_file(args)
        return args.func(args)
    except ValueError as err:
        print(f"mop-train {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mop-train layout ... | head`: the reader left, nothing is wrong
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    from mop_train.train.__main__ import leave  # (the shutdown skips its full collections)
    leave(main())


def _verify_checkpoint(checkpoint: str) -> None:
    """The checkpoint's files against its manifest (train/integrity.py): one streamed read of each."""
    from mop_train.train import integrity

    problems = integrity.verify(checkpoint, rank=0, world=1)
    if problems:
        raise ValueError(f"checkpoint {checkpoint} failed verification: " + "; ".join(problems[:3])
                         + "; export a complete checkpoint (or pass --no-verify to export it anyway)")
