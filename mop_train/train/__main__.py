"""`python -m mop_train.train ...` / `torchrun ... -m mop_train.train ...`: run the training loop.

A configuration or input error (ValueError) prints one line naming the problem and exits with 2.
"""

import sys

from mop_train.train.loop import main

if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"mop_train.train: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
