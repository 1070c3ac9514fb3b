"""Fault injection (``--chaos``): the faults a run is made to survive, and the record of each.

A spec is one fault or several joined by ``;``::

    kill:step=S,rank=R          that worker SIGKILLs itself right after step S
    kill-host:step=S,host=H     host H is lost after step S: its trainer, its keeper (the snapshots
                                in its memory) and its local disk's snapshots
    stop:step=S,rank=R          that worker freezes (SIGSTOP) after step S: its sockets stay open,
                                so its peers get no reset and only the heartbeat can tell
    cut:step=S,host=H           host H's link goes down after step S (emulated links only)
    kill:every=60s              every 60 s of training a random worker is SIGKILLed (seeded)

each optionally with ``restart=SECONDS``: how long the replacement takes to come up (default 0);
and one that breaks no process but what a worker sends:

    corrupt:step=S,rank=R[,kind=nan|inf|signflip][,scale=X]
                                that worker's next contribution to an average, from step S on, is
                                spoiled (all NaN by default, or scaled by X, or its sign flipped);
    corrupt:every=K,rank=R,...  the same at steps K, 2K, ... (the comm/guard.py checks must catch it)

Step-triggered faults fire inside the trainer, at an exact step, so tests are deterministic; the
timed ones are fired by the launcher, as a real failure would be, from outside the process.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ACCEPTED = (
    "kill:step=S,rank=R | kill-host:step=S,host=H | stop:step=S,rank=R | cut:step=S,host=H | "
    "kill:every=SECONDS, each with optional ,restart=SECONDS | "
    "corrupt:step=S|every=K,rank=R[,kind=nan|inf|signflip][,scale=X][,part=shard|stamp]"
)
KINDS = ("kill", "kill-host", "stop", "cut", "corrupt")
CORRUPTIONS = ("nan", "inf", "signflip", "scale")
BY_HOST = ("kill-host", "cut")  # faults aimed at a host (host=H) rather than a worker (rank=R)


class ChaosError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    step: int = 0  # fire after this step (step-triggered)
    rank: int = -1
    every_s: float = 0.0  # fire every this many seconds (timed)
    restart_s: float = 0.0
    every_steps: int = 0  # corrupt: at every multiple of this step
    corruption: str = ""  # corrupt: nan | inf | signflip | scale=X
    # corrupt: "shard" spoils the worker's shard of a quantised codec's mean (its second phase),
    # not its contribution; "stamp" sends its copies of shards (owners=2) under a false stamp
    part: str = ""

    def corrupts_at(self, step: int, rank: int) -> bool:
        """A corrupt fault aimed at ``rank`` that spoils its next contribution from ``step``."""
        if self.kind != "corrupt" or self.rank != rank:
            return False
        return step == self.step if not self.every_steps else step % self.every_steps == 0

    @property
    def timed(self) -> bool:
        return self.every_s > 0

    @staticmethod
    def _num(x: float) -> str:
        return format(x, "f").rstrip("0").rstrip(".")  # never an exponent: _seconds reads it back

    def spec(self) -> str:
        if self.kind == "corrupt":
            when = f"every={self.every_steps}" if self.every_steps else f"step={self.step}"
            how = self.corruption if self.corruption.startswith("scale=") else f"kind={self.corruption}"
            if self.part == "stamp":  # nothing spoiled but the stamp: no kind
                return f"corrupt:{when},rank={self.rank},part=stamp"
            return f"corrupt:{when},rank={self.rank},{how}" + (f",part={self.part}" if self.part else "")
        who = f"host={self.rank}" if self.kind in BY_HOST else f"rank={self.rank}"
        if self.timed:
            head = f"{self.kind}:every={self._num(self.every_s)}s"
        else:
            head = f"{self.kind}:step={self.step},{who}"
        return head + (f",restart={self._num(self.restart_s)}" if self.restart_s else "")


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)?", text)
    if not m:
        raise ChaosError(f"{text!r} is not a duration (e.g. 60s, 2m)")
    return float(m.group(1)) * (60 if m.group(2) == "m" else 1)


def parse_chaos(spec: str, workers: int | None = None) -> list[Fault]:
    """The faults of a ``--chaos`` spec; ChaosError says what is wrong and what is accepted."""
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, _, args = part.partition(":")
        if kind not in KINDS or not args:
            raise ChaosError(f"--chaos {part!r}: accepted: {ACCEPTED}")
        fields: dict[str, str] = {}
        for item in args.split(","):
            key, eq, value = item.partition("=")
            if not eq or key in fields:
                raise ChaosError(f"--chaos {part!r}: accepted: {ACCEPTED}")
            fields[key] = value
        if kind == "corrupt":
            faults.append(_corrupt(part, fields, workers))
            continue
        who = "host" if kind in BY_HOST else "rank"
        allowed = ({"every"} if "every" in fields else {"step", who}) | {"restart"}
        if set(fields) - allowed or ("every" not in fields and {"step", who} - set(fields)):
            raise ChaosError(f"--chaos {part!r}: accepted: {ACCEPTED}")
        try:
            restart = _seconds(fields["restart"]) if "restart" in fields else 0.0
            if "every" in fields:
                if kind != "kill":
                    raise ChaosError("only kill takes every=")
                every = _seconds(fields["every"])
                if every <= 0:
                    raise ChaosError("every= must be > 0")
                faults.append(Fault("kill", every_s=every, restart_s=restart))
                continue
            step, rank = int(fields["step"]), int(fields[who])
        except (ChaosError, ValueError) as e:
            raise ChaosError(f"--chaos {part!r}: {e}; accepted: {ACCEPTED}") from None
        if step < 1 or rank < 0:
            raise ChaosError(f"--chaos {part!r}: step must be >= 1 and {who} >= 0")
        if workers is not None and rank >= workers:
            raise ChaosError(f"--chaos {part!r}: there are {workers} workers ({who} 0 to {workers - 1})")
        faults.append(Fault(kind, step=step, rank=rank, restart_s=restart))
    return faults


def _corrupt(part: str, fields: dict[str, str], workers: int | None) -> Fault:
    accepted = "corrupt:step=S|every=K,rank=R[,kind=nan|inf|signflip][,scale=X][,part=shard|stamp]"
    when = {"step", "every"} & set(fields)
    known = {"step", "every", "rank", "kind", "scale", "part"}
    if (
        len(when) != 1
        or "rank" not in fields
        or set(fields) - known
        or fields.get("part", "shard") not in ("shard", "stamp")
        or (fields.get("part") == "stamp" and {"kind", "scale"} & set(fields))
    ):
        raise ChaosError(f"--chaos {part!r}: accepted: {accepted}")
    try:
        step = int(fields.get("step", 0))
        every = int(fields.get("every", 0))
        rank = int(fields["rank"])
        scale = float(fields["scale"]) if "scale" in fields else None
    except ValueError as e:
        raise ChaosError(f"--chaos {part!r}: {e}; accepted: {accepted}") from None
    kind = fields.get("kind", "scale" if scale is not None else "nan")
    if kind not in CORRUPTIONS or (kind == "scale") != (scale is not None):
        raise ChaosError(f"--chaos {part!r}: kind is one of nan, inf, signflip, or give scale=X alone")
    if max(step, every) < 1 or rank < 0:
        raise ChaosError(f"--chaos {part!r}: step (or every) must be >= 1 and rank >= 0")
    if workers is not None and rank >= workers:
        raise ChaosError(f"--chaos {part!r}: there are {workers} workers (rank 0 to {workers - 1})")
    corruption = f"scale={scale:g}" if scale is not None else kind
    if fields.get("part") == "stamp":  # a false owners' stamp: nothing else is spoiled
        corruption = "stamp"
    return Fault(
        "corrupt", step=step, rank=rank, every_steps=every, corruption=corruption, part=fields.get("part", "")
    )


def join_chaos(faults: list[Fault]) -> str:
    return ";".join(f.spec() for f in faults)


def fired_marker(control_dir: Path, fault: Fault) -> Path:
    """The file a trainer leaves just before it carries out ``fault``: the launcher's proof that
    the fault fired (peers can run past its step before the fault is noticed)."""
    return control_dir / ("fired-" + fault.spec().replace(":", "-").replace(",", "-").replace("=", ""))


def fire_at_step(
    faults: list[Fault],
    step: int,
    rank: int,
    keeper_pid: int,
    snap_dir: Path | None,
    control_dir: Path | None = None,
    settle: Callable[[], None] | None = None,
) -> None:
    """In the trainer, after ``step``: carry out the step-triggered fault aimed at this worker.

    ``settle`` waits until the snapshots this worker took before the fault are with its keeper.
    A store takes milliseconds and a real step seconds; on the tests' tiny models a step is
    shorter than a store, and a fault striking mid-store would move the rollback point by
    chance. (A failure during a store is still survived: the run goes back one snapshot more.)"""
    for f in faults:
        if f.timed or f.kind == "corrupt" or f.step != step or f.rank != rank:
            continue
        if settle is not None:
            settle()
        if control_dir is not None:
            with contextlib.suppress(OSError):
                fired_marker(control_dir, f).touch()
        what = {
            "kill": "kills itself",
            "kill-host": "kills its host (trainer, keeper, disk)",
            "stop": "freezes (SIGSTOP)",
            "cut": "cuts its host's link",
        }[f.kind]
        print(f"geotrain: chaos: rank {rank} {what} after step {step}", file=sys.stderr, flush=True)
        if f.kind == "cut":
            from geotrain.netem.cluster import IFNAME

            subprocess.run(["ip", "link", "set", IFNAME, "down"], check=True)
            return
        if f.kind == "kill-host":
            if keeper_pid > 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(keeper_pid, signal.SIGKILL)
            if snap_dir is not None:
                shutil.rmtree(snap_dir / f"rank{rank}", ignore_errors=True)
        os.kill(os.getpid(), signal.SIGSTOP if f.kind == "stop" else signal.SIGKILL)
