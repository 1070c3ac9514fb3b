"""Each host's agent: torchrun itself (``torch.distributed.run``), with its report of a failed
trainer kept out of the user's terminal.

When a trainer dies (a fault, ``--chaos``), torchrun raises ``ChildFailedError`` and Python prints
its 25-line traceback and report; the launcher echoes every host's output, so each lost host put
that block between the progress lines, under the launcher's own one-line account of the same
failure ("host 2 failed after step 7 (kill); ..."). Here the report becomes one line marked for
the host's log only (``launch/procs.py`` does not echo it); the exit code is torchrun's own.
So does torchrun's traceback when the launcher stops a host with SIGTERM because another failed,
also when that signal comes after torchrun's ``main()`` is over: its handler stays installed and
raised ``SignalException`` inside the interpreter's exit (a weakref finaliser), a traceback CI saw.
And so does torchrun's traceback when its exit barrier fails after every trainer has finished:
host 0's agent serves the store the agents meet in, and it may pass the barrier and exit before
another agent's wait has read the answer (CI, the stop after 51: "Failed to recv, got 0 bytes").
"""

from __future__ import annotations

import logging
import os
import signal
import sys

LOG_ONLY = "geotrain agent:"  # lines the launcher writes to the host's log and does not echo
TRAINER_LOG_ONLY = "geotrain log:"  # a trainer's lines kept to the host's log the same way

_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # those torchrun's agent takes over
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"  # torchrun's agent logs as this module
_EXIT_BARRIER_ERROR = "Error waiting on exit barrier"


class ExitBarrierToLog(logging.Filter):
    """Turns torchrun's logged traceback of a failed exit barrier into one line for the host's
    log. The barrier only keeps agents alive until all have finished; its failure changes neither
    the agent's exit code nor what the trainers did, and a real fault is reported by the launcher."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(_EXIT_BARRIER_ERROR):
            return True
        error = record.exc_info[1] if record.exc_info else None
        reason = f"{type(error).__name__}: {error}" if error is not None else "no reason given"
        print(
            f"{LOG_ONLY} the exit barrier failed after the trainers finished ({reason}); "
            "a connection lost there is the serving agent's exit, a timeout a slow peer's",
            file=sys.stderr,
            flush=True,
        )
        return False


def keep_exit_barrier_errors_to_the_log() -> None:
    logging.getLogger(_AGENT_LOGGER).addFilter(ExitBarrierToLog())


def exit_quietly_on_signals() -> None:
    """From here on a stop signal ends the process at once with 128 + its number (what the shell
    reports), instead of torchrun's handler raising an exception wherever the interpreter is."""

    def _exit(signum: int, _frame: object) -> None:
        os._exit(128 + signum)

    for name in _STOP_SIGNALS:
        signal.signal(getattr(signal, name), _exit)


if __name__ == "__main__":  # torch only here: the launcher imports LOG_ONLY
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    keep_exit_barrier_errors_to_the_log()
    try:
        main()
    except SignalException as e:  # the launcher stops this host (another failed): no traceback
        exit_quietly_on_signals()
        print(f"{LOG_ONLY} stopped by signal {e.sigval.name}", file=sys.stderr, flush=True)
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        exit_quietly_on_signals()
        rank, failure = e.get_first_failure()
        print(
            f"{LOG_ONLY} the trainer (rank {rank}, pid {failure.pid}) exited with code "
            f"{failure.exitcode} ({failure.signal_name()})",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    finally:  # the launcher may stop this host while it exits
        exit_quietly_on_signals()
