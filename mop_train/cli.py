"""`mop-train`: inspection commands that need no GPU and no process group.

    mop-train layout --world 64 --seq 8 --expert 64 --vocab 8   # print the MoP rank layout
    mop-train zoo                                               # the named models and their sizes

Training itself is launched with torchrun: `torchrun ... -m mop_train.train --job.config_file X.toml`.
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"mop-train {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mop-train layout ... | head`: the reader left, nothing is wrong
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
