"""Context-length sweep: one sequence per sequence group, each length a real training run.

    python scripts/sweep_context.py --config configs/small_1gpu.toml --nproc 2 --reach 32768 \
        --point-timeout 300 --budget-s 3000 -- --mop.layout.seq_degree 2 --mop.layout.expert_degree 2
    python scripts/sweep_context.py --config configs/small_1gpu.toml --nproc 2 --bisect 131072 262144
    python scripts/sweep_context.py --config configs/mop_37b.toml --nproc 8 --seq-lens 65536 262144

--reach START doubles from START until a length does not complete (or --max), then bisects to 1/8
of the last bracket; --bisect LO HI runs LO, HI, then bisects; --seq-lens runs each length.
Lengths stay multiples of 1024 in a search. Prints tokens/s, TFLOP/s and peak memory per length;
writes JSON + CSV + PNG (see mop_train/sweep.py; the PNG needs the `sweep` extra:
`pip install -e '.[sweep]'`, which README's install command includes).
"""

from mop_train.sweep import common_parser, search_from_args, sweep

MULTIPLE = 1024


def main() -> None:
    parser = common_parser(__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--seq-lens", type=int, nargs="+", help="context lengths to try, each one")
    mode.add_argument("--reach", type=int, metavar="START", help="double from START, then bisect")
    parser.add_argument("--max", type=int, default=1 << 22, help="largest length a --reach search tries")
    args = parser.parse_args()
    search = search_from_args(args, start=args.reach, limit=args.max, multiple=MULTIPLE)
    if search is None and not args.seq_lens:
        parser.error("give --seq-lens, --reach START or --bisect LO HI")
    if search is not None and args.seq_lens:
        parser.error("--seq-lens and --bisect are alternatives")
    sweep("context", "seq_len", lambda s: ["--training.seq_len", str(s), "--training.local_batch_size", "1"],
          args, values=args.seq_lens, search=search)


if __name__ == "__main__":
    main()
