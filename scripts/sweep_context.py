"""Context-length sweep: one sequence per sequence group, each length a real training run.

    python scripts/sweep_context.py --config configs/mop_37b.toml --nproc 8 \
        --seq-lens 16384 32768 65536 131072 262144 524288 1048576 -- --mop.layout.seq_degree 8

Prints tokens/s, TFLOP/s and peak memory per length and writes JSON (see mop_train/sweep.py).
"""

from mop_train.sweep import common_parser, sweep


def main() -> None:
    parser = common_parser(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", required=True, help="context lengths to try")
    args = parser.parse_args()
    sweep("context", "seq_len", args.seq_lens,
          lambda s: ["--training.seq_len", str(s), "--training.local_batch_size", "1"], args,
          stop_at_failure=False)


if __name__ == "__main__":
    main()
