"""Batch sweep at a fixed context: local batch sizes in increasing order until one does not complete.

    python scripts/sweep_batch.py --config configs/small_1gpu.toml --nproc 1 --seq-len 8192 --batches 1 2 4 8 16

The largest completing global batch is local_batch x W / D sequences (see the README's batch semantics).
"""

from mop_train.sweep import common_parser, sweep


def main() -> None:
    parser = common_parser(__doc__)
    parser.add_argument("--seq-len", type=int, required=True, help="context length")
    parser.add_argument("--batches", type=int, nargs="+", required=True, help="local batch sizes, increasing")
    args = parser.parse_args()
    sweep("batch", "local_batch", sorted(args.batches),
          lambda b: ["--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(b)], args,
          stop_at_failure=True)


if __name__ == "__main__":
    main()
