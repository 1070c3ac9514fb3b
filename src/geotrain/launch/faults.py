"""What the launcher knows about faults: when a host failed, how far the run had come, how long the
run took to get going again, and the timed chaos it fires itself.

Under ``--on-failure rollback`` a failed host does not end the run: every trainer is stopped, a
replacement takes the failed one's place, and all continue from the newest snapshot that every
worker can restore (its keeper's memory, its disk, or rebuilt from its peers' redundancy), so the
run ends bitwise as it would have without the fault. Each fault is recorded for the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from geotrain.ft.chaos import Fault


@dataclass
class FaultRecord:
    kind: str  # kill | kill-host | exit (a host that failed on its own)
    rank: int
    at_s: float  # seconds since the launch
    at_step: int  # the furthest step any worker had finished
    detected_s: float  # from the failed worker's last sign of life to the launcher noticing
    rollback_to: int = -1
    steps_lost: int = 0
    sources: list[str] | None = None
    recover_s: float | None = None  # from detection to the first new step after the rollback
    exit_code: int | None = None
    # With continue and restart=: the step after which the replacement was admitted, and the
    # seconds from its start to its admission (the state handed over included).
    rejoined_after_step: int | None = None
    rejoin_s: float | None = None
    detected_at: float = 0.0  # wall clock: for recover_s, and where the soak's plot draws it
    rejoin_started_at: float = 0.0  # wall clock, for rejoin_s; not reported

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["rejoin_started_at"]
        return d


def last_step(run_dir: Path, rank: int) -> tuple[int, float]:
    """The newest step in a worker's metrics file, and when that line was written (0, 0 if none)."""
    path = run_dir / "metrics" / f"rank{rank}.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().splitlines()
        mtime = path.stat().st_mtime
    except OSError:
        return 0, 0.0
    for line in reversed(lines):
        with contextlib.suppress(ValueError, KeyError):
            record = json.loads(line)
            if not record.get("final"):
                return int(record["step"]), mtime
    return 0, mtime


def trainer_pid(agent_pid: int) -> int | None:
    """The trainer process torchrun's agent started (its only child), or None before it exists."""
    try:
        children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


class TimedChaos:
    """Fires ``kill:every=T`` faults from outside the trainers: a seeded random worker, SIGKILL."""

    def __init__(self, faults: list[Fault], seed: int) -> None:
        self.faults = [f for f in faults if f.timed]
        self.rng = random.Random(seed)
        self.next_at: list[float] = []
        self.fired: tuple[Fault, int, float] | None = None  # (fault, rank, wall time) last fired

    def arm(self, now: float) -> None:
        """(Re)start the clocks: at launch and after each recovery."""
        self.next_at = [now + f.every_s for f in self.faults]

    def poll(self, now: float, trainer_pids: list[int | None]) -> None:
        """Fire what is due at a random live worker (``None``: not running, not a target)."""
        for i, f in enumerate(self.faults):
            if now < self.next_at[i]:
                continue
            self.next_at[i] = now + f.every_s
            live = [r for r, pid in enumerate(trainer_pids) if pid]
            if not live:
                continue
            rank = self.rng.choice(live)
            with contextlib.suppress(ProcessLookupError):
                os.kill(trainer_pids[rank], signal.SIGKILL)
                self.fired = (f, rank, time.time())
