"""The launcher's child processes, whatever they run (a host's torchrun, a joiner, the coordinator):
the environment they get, a session of their own that dies with the launcher, their output pumped
into a log and, less the lines meant for the log only, to the terminal, and how they are stopped
together with everything below them.

Separate from ``local.py``, which decides what runs where and when: nothing here knows about
training, faults or keepers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from geotrain.launch.admission import TOKEN_ENV
from geotrain.launch.agent import LOG_ONLY as AGENT_LOG_ONLY
from geotrain.launch.agent import TRAINER_LOG_ONLY
from geotrain.netem.cluster import IFNAME, EmulatedCluster


def die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, and leave the terminal's Ctrl-C to the launcher."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def host_env(cluster: EmulatedCluster | None, threads: int, token: str = "", gpu: str = "") -> dict[str, str]:
    return dict(
        os.environ,
        **({TOKEN_ENV: token} if token else {}),  # in the environment, never on a command line
        **({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {}),  # each host its GPU, as on a machine of its own
        OMP_NUM_THREADS=str(threads),
        RAYON_NUM_THREADS=str(threads),  # BLAKE3's pool for digests (comm/digest.py): a host's share
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME=IFNAME if cluster else "lo",
        LOGLEVEL="WARNING",
        # c10d warns that namespace addresses have no reverse DNS name; harmless.
        TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    )


# torchrun agents that do not host the rendezvous warn when the host agent exits first; harmless,
# kept in the host logs, kept off the terminal.
_QUIET = (  # written to the host's log, not echoed: the launcher reports the failure itself
    b"failed to shutdown the rendezvous",
    AGENT_LOG_ONLY.encode(),
    TRAINER_LOG_ONLY.encode(),  # e.g. the traceback of a trainer whose peer was lost
    b"failed (exitcode: ",  # torchrun's log line for a trainer that died
    b"death signal, shutting down workers",  # torchrun's agent, stopped by the launcher
    b"closing signal SIGTERM",  # and its trainer, stopped with it
)


def pump(stream: IO[bytes], log: IO[bytes], echo: bool) -> None:
    # A line that arrives in two reads is held until it ends, so that a quiet one is known as
    # such whole; not a progress bar's update (after a \r), which must show at once.
    held, at_line_start, logging = b"", True, True
    for chunk in iter(lambda: stream.read1(4096), b""):
        if logging:
            try:
                log.write(chunk)
                log.flush()
            except OSError as e:  # a full disk: the host's output is still echoed (or drained)
                logging = False
                print(
                    f"geotrain: host log {getattr(log, 'name', '')} not written further: {e}", file=sys.stderr
                )
        if not echo:
            continue
        lines = (held + chunk).splitlines(True)
        fresh = (bool(held) or at_line_start) if len(lines) == 1 else lines[-2].endswith(b"\n")
        held = lines.pop() if not lines[-1].endswith((b"\n", b"\r")) and fresh else b""
        if not held:
            at_line_start = lines[-1].endswith(b"\n")
        _echo(lines)
    if echo and held:
        _echo([held])


def _echo(lines: list[bytes]) -> None:
    out = b"".join(ln for ln in lines if not any(q in ln for q in _QUIET))
    if out:
        sys.stderr.buffer.write(out)
        sys.stderr.buffer.flush()


def tail_of(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return ""
    keep = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join("    " + ln for ln in keep[-lines:])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            with contextlib.suppress(OSError, ValueError):
                kids = [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
                out += kids
                todo += kids
    return out


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    # Collected first: once an agent is gone its workers are orphans, out of reach of killpg.
    below = {p.pid: _descendants(p.pid) if p.poll() is None else [] for p in procs}
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in below[p.pid]:  # a frozen (SIGSTOPped) worker ignores SIGTERM; not SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
