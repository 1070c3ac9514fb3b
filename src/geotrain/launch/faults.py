"""What the launcher knows about faults: when a host failed, how far the run had come, how long the
run took to get going again, and the timed chaos it fires itself.

Under ``--on-failure rollback`` a failed host does not end the run: every trainer is stopped, a
replacement takes the failed one's place, and all continue from the newest snapshot that every
worker can restore (its keeper's memory, its disk, or rebuilt from its peers' redundancy), so the
run ends bitwise as it would have without the fault. Each fault is recorded for the summary.

Here too: the rollback itself, the fault records kept in ``faults.json`` across a run's launches,
what each fault cost the survivors under ``--on-failure continue`` (from the trainers' regroup
records), and ``RunFailed``, the launcher's error for a run that cannot go on (here, below
``local.py``, so that ``control.py`` raises it too; ``local.py`` exports it as before).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from geotrain.ft.atomic import write_atomic
from geotrain.ft.chaos import Fault, join_chaos
from geotrain.ft.keeper import KeeperClient, KeeperError
from geotrain.launch.coordinator import read_jsonl
from geotrain.launch.keepers import start_keepers
from geotrain.metrics import metrics_up_to

if TYPE_CHECKING:
    from geotrain.launch.local import LaunchConfig
    from geotrain.train_config import TrainConfig


class RunFailed(RuntimeError):
    pass


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


_REGROUP_TIMES = ("wait_s", "hand_over_s", "regroup_s", "redo_sync_s")


def regroup_events(control: Path) -> list[dict]:
    """Every epoch the trainers formed, oldest first, merged over the hosts' own records (the
    summary's writer knows only those since it joined): the times of the slowest member that was
    one before (a joiner's own wait for the boundary is its ``rejoin_s``), ``step`` the earliest
    step a member went on after (between syncs of the local methods each goes on from its own),
    and at an admission how many different parameter digests the members had (1: bitwise
    equal; ``param_digests``), and of what they hold equal there (``shared_digests``: the
    parameters, or the anchor of a method whose replicas differ between syncs; None where the
    method holds nothing equal at a boundary: DreamDDP without a codec)."""
    merged: dict[int, dict] = {}
    digests: dict[str, dict[int, set]] = {"param_digest": {}, "shared_digest": {}}
    for path in sorted(control.glob("regroups-h*.jsonl")):
        for e in read_jsonl(path):
            host = e.pop("host", None)
            for key, seen in digests.items():  # each member's own
                recorded, digest = key in e, e.pop(key, None)
                if digest is not None:
                    seen.setdefault(e["epoch"], set()).add(digest)
                elif recorded:  # recorded as nothing held equal
                    seen.setdefault(e["epoch"], set())
            m = merged.setdefault(e["epoch"], {**e, **dict.fromkeys(_REGROUP_TIMES, 0.0)})
            if host not in e["joined"]:
                for k in _REGROUP_TIMES:
                    m[k] = max(m[k], e.get(k, 0))
            m["handed_over_bytes"] = max(m.get("handed_over_bytes", 0), e.get("handed_over_bytes", 0))
            m["step"] = min(m["step"], e["step"])
            m["at"] = min(m["at"], e["at"])
            m["joined"] = sorted(set(m["joined"]) | set(e["joined"]))
    for key, by_epoch in digests.items():
        for epoch, seen in by_epoch.items():
            merged[epoch][f"{key}s"] = len(seen) or None
    # A deferred admission's members waited for the joiners at their next sync for what the
    # hand-over took past their period (``train``): the slowest member's wait
    for path in sorted(control.glob("meetings-h*.jsonl")):
        for w in read_jsonl(path):
            if w.get("epoch") in merged:
                m = merged[w["epoch"]]
                m["meeting_wait_s"] = max(m.get("meeting_wait_s", 0.0), float(w["meeting_wait_s"]))
    return [merged[e] for e in sorted(merged)]


def credit_regroups(records: list[FaultRecord], events: list[dict]) -> None:
    """With continue, what each fault cost the survivors, from the trainers' regroup events: the
    step they went on after, and when its replacement was admitted. ``steps_lost`` stays 0: a
    member goes on from its own step or from a leader's further one, never redoing a finished
    step; except after a fault that took the last member holding the state, where every host
    was restored from the snapshots (``sources`` set, by ``roll_back``)."""
    for record in records:
        after = [e for e in events if e.get("at", 0) >= record.detected_at - 1.0]
        event = next((e for e in after if record.rank not in e["members"] and not e.get("joined")), None)
        if event is not None and record.sources is None:  # (sources: every host was restored)
            record.rollback_to = event["step"]
        if record.rejoin_started_at:
            # Before the same host fails again: a replacement killed while it waited has none.
            until = min(
                (
                    r.detected_at
                    for r in records
                    if r.rank == record.rank and r.detected_at > record.detected_at
                ),
                default=float("inf"),
            )
            admitted = next(
                (
                    e for e in after
                    if record.rank in e.get("joined", []) and record.rejoin_started_at <= e["at"] < until
                ),
                None,
            )  # fmt: skip
            if admitted is not None:
                record.rejoined_after_step = admitted["step"]
                record.rejoin_s = round(admitted["at"] - record.rejoin_started_at, 2)


def read_faults(run_dir: Path) -> list[FaultRecord]:
    """The faults of earlier launches of this run (a resumed run keeps counting)."""
    try:
        return [FaultRecord(**r) for r in json.loads((run_dir / "faults.json").read_text())]
    except (OSError, ValueError, TypeError):
        return []


def write_faults(run_dir: Path, records: list[FaultRecord]) -> None:
    text = json.dumps([r.as_dict() for r in records], indent=2) + "\n"
    write_atomic(run_dir / "faults.json", text.encode())


def roll_back(
    run_dir: Path,
    launch: LaunchConfig,
    cfg: TrainConfig,
    sockets: list[Path],
    faults: list,
    record: FaultRecord,
) -> TrainConfig:
    """After a fault: replacement keepers for lost hosts, then the step every worker restores."""
    from geotrain.ft.snapshots import NoCommonStep, ResumeError, preflight

    try:
        if sockets:
            start_keepers(run_dir, launch.workers, resume=True)
        keepers = [KeeperClient(s, timeout_s=60.0) for s in sockets] or [None] * launch.workers
        step, how = preflight(keepers, run_dir / "snapshots", check=False)
    except NoCommonStep as e:
        # Every worker can start over; that is the newest point all of them share. What the
        # keepers hold is of the abandoned attempt, and would outrank the new run's snapshots.
        print(f"geotrain: {e}; all workers start over from step 0", file=sys.stderr, flush=True)
        step, how = 0, {}
        for keeper in keepers:
            if keeper is not None:
                with contextlib.suppress(KeeperError):
                    keeper.drop_after(0)
    except (ResumeError, KeeperError) as e:
        raise RunFailed(f"cannot roll back after the fault: {e}") from None
    for rank in range(launch.workers):  # so that progress past ``step`` means the run goes on
        metrics_up_to(run_dir, rank, step)
    record.rollback_to, record.steps_lost = step, record.at_step - step
    record.sources = [how[r] for r in sorted(how)]
    return replace(cfg, resume=bool(how), resume_step=step, chaos=join_chaos(faults))
