"""Batch sweep at a fixed context: local batch sizes in increasing order until one does not complete.

    python scripts/sweep_batch.py --config configs/small_1gpu.toml --nproc 1 --seq-len 8192 --batches 1 2 4 8 16
    python scripts/sweep_batch.py --config configs/small_1gpu.toml --nproc 2 --seq-len 8192 --reach 1 --point-timeout 300
    python scripts/sweep_batch.py --config configs/small_1gpu.toml --nproc 2 --seq-len 8192 --bisect 8 16

--reach START doubles the local batch from START until one does not complete (or --max), then
bisects to 1/8 of the last bracket; --bisect LO HI runs LO, HI, then bisects. The largest
completing global batch is local_batch x W / D sequences (see the README's batch semantics).
Writes JSON + CSV + PNG (the PNG needs the `sweep` extra: `pip install -e '.[sweep]'`).
"""

from mop_train.sweep import common_parser, search_from_args, sweep


def main() -> None:
    parser = common_parser(__doc__)
    parser.add_argument("--seq-len", type=int, required=True, help="context length")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--batches", type=int, nargs="+", help="local batch sizes (run in increasing order)")
    mode.add_argument("--reach", type=int, metavar="START", help="double the local batch from START, then bisect")
    parser.add_argument("--max", type=int, default=4096, help="largest local batch a --reach search tries")
    args = parser.parse_args()
    search = search_from_args(args, start=args.reach, limit=args.max, multiple=1)
    if search is None and not args.batches:
        parser.error("give --batches, --reach START or --bisect LO HI")
    if search is not None and args.batches:
        parser.error("--batches and --bisect are alternatives")
    sweep("batch", "local_batch",
          lambda b: ["--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(b)], args,
          values=sorted(args.batches) if args.batches else None, search=search, stop_at_failure=True)


if __name__ == "__main__":
    main()
