"""`python -m mop_train.train ...` / `torchrun ... -m mop_train.train ...`: run the training loop.

Every way of stopping short has its own exit code (mop_train.train.reliability): a configuration
or input error (ValueError) exits 2, a non-finite run 3, a bad checkpoint 4, SIGTERM 5, a hung
collective 6, a dump folder held by another job 7. The message is one line on stderr, printed by
rank 0 alone when every rank stops for the same reason (torchrun stops the others while they wait
to print theirs); a rank that alone met an error prints it, naming itself.
"""

import os
import signal
import sys
import time

from mop_train.train.reliability import EXIT_CONFIG, EXIT_HUNG, TrainingStop, is_timeout


QUIET_RANK_DELAY_S = 5.0
"""How long a rank other than 0 waits before it prints its error. When rank 0 stops for the same
reason, torchrun stops this rank within that time (SIGTERM, restored to its default here) and the
error is printed once; an error that only this rank met is still printed, after the wait."""


def _report(message: str, *, every_rank: bool = False) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if not every_rank and rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(QUIET_RANK_DELAY_S)
        every_rank = True
    prefix = f"mop_train.train (rank {rank})" if every_rank else "mop_train.train"
    print(f"{prefix}: error: {message}", file=sys.stderr, flush=True)


def run() -> int:
    from mop_train.train.loop import main

    try:
        main()
    except ValueError as err:
        _report(str(err))
        return EXIT_CONFIG
    except TrainingStop as err:
        _report(str(err), every_rank=err.every_rank)
        return err.exit_code
    except RuntimeError as err:
        if not is_timeout(err):
            raise
        _report(f"a collective did not complete within the timeout (comm.init_timeout_seconds before "
                f"step 1, comm.train_timeout_seconds after): {str(err).splitlines()[0]}", every_rank=True)
        return EXIT_HUNG
    return 0


if __name__ == "__main__":
    sys.exit(run())
