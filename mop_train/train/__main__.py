"""`python -m mop_train.train ...` / `torchrun ... -m mop_train.train ...`: run the training loop.

Every way of stopping short has its own exit code (mop_train.train.reliability): a configuration
or input error (ValueError) exits 2, a non-finite run 3, a bad checkpoint 4, SIGTERM 5, a hung
collective 6, a dump folder held by another job 7. The message is one line on stderr. A stop that
every rank reached through one collective decision (SIGTERM, non-finite steps, a checkpoint
refused, a held dump folder: `TrainingStop.agreed`) is printed by rank 0 alone, the other ranks
leave silently. For any other error a rank other than 0 waits before printing (torchrun stops it
meanwhile when rank 0 failed too); an error that only this rank met is printed, naming the rank.

Under torchrun the message also goes to the rank's torchelastic error file
(TORCHELASTIC_ERROR_FILE), so torchrun's failure summary shows it as the root cause instead of a
link to its docs. torchrun itself still exits 1 when a rank fails (and with a traceback after a
SIGTERM); `mop-train train` exits with the ranks' own code (mop_train/cli.py).

On the way out (`leave`), once the run has returned, every object still alive moves to the garbage
collector's permanent generation (`gc.freeze()`), so the interpreter's shutdown does not walk the
whole heap (torch, torchtitan, sympy: millions of objects) in several full collections: about 2 s
of CPU per rank on CI's CPU. Everything the run wrote is closed by then (the loop closes its
loggers, checkpointer and process group in `train`/`main`); what stays alive is freed with the
process, as CPython already allows for objects alive at exit.
"""

import gc
import json
import os
import signal
import sys
import time

from mop_train.train.reliability import EXIT_CONFIG, EXIT_HUNG, TrainingStop, is_timeout


QUIET_RANK_DELAY_S = 5.0
"""How long a rank other than 0 waits before it prints an error not known to be agreed. When rank 0
stops for the same reason, torchrun stops this rank within that time (SIGTERM, restored to its
default here) and the error is printed once; an error that only this rank met is still printed,
after the wait."""


def _report(message: str, exit_code: int, *, every_rank: bool = False, agreed: bool = False) -> None:
    rank = int(os.environ.get("RANK", "0"))
    beside_rank0 = rank != 0 and "TORCHELASTIC_RUN_ID" in os.environ   # else a fake world's lone rank
    if beside_rank0 and agreed and not every_rank:
        return   # rank 0 prints the same line
    if beside_rank0 and not every_rank:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(QUIET_RANK_DELAY_S)
    prefix = f"mop_train.train (rank {rank})" if rank != 0 or every_rank else "mop_train.train"
    print(f"{prefix}: error: {message}", file=sys.stderr, flush=True)
    _write_error_file(f"exit {exit_code}: {message}")


def _write_error_file(message: str) -> None:
    """torchelastic's error-file format (a string message and a timestamp) for torchrun's summary."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)
    except OSError:
        pass   # the summary then shows torchrun's own words; the message is on stderr anyway


def run() -> int:
    from mop_train.train.loop import main

    try:
        main()
    except ValueError as err:
        _report(str(err), EXIT_CONFIG)
        return EXIT_CONFIG
    except TrainingStop as err:
        _report(str(err), err.exit_code, every_rank=err.every_rank, agreed=err.agreed)
        return err.exit_code
    except RuntimeError as err:
        if not is_timeout(err):
            raise
        _report(f"a collective did not complete within the timeout (comm.init_timeout_seconds before "
                f"step 1, comm.train_timeout_seconds after): {str(err).splitlines()[0]}", EXIT_HUNG,
                every_rank=True)
        return EXIT_HUNG
    return 0


def leave(code: int) -> None:
    """Leave with `code`, skipping the shutdown's full collections (module docstring)."""
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    leave(run())
