"""The keepers of ``geotrain run``: one process per host that holds its worker's snapshots in
memory (``ft/keeper.py``), started, stopped, asked to write what they hold to disk, and found
again by socket path when a run is resumed or its launcher is gone.

Separate from ``local.py``: ``geotrain run --resume`` (before it launches), ``geotrain sweep
--keepers``, the tests and the benchmarks reach a run's keepers without launching one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from geotrain.ft.keeper import KeeperClient, KeeperError, wait_ready
from geotrain.ft.snapshots import NoCommonStep, availability, choose_step

# Seconds a keeper of a failed or interrupted run keeps its snapshots in memory for `--resume`.
KEEPER_LINGER_S = 600.0


def keeper_socket(run_dir: Path, host: int) -> Path:
    """Host ``host``'s keeper socket for this run directory (short: a socket path is <= 107 bytes)."""
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "geotrain-keepers" / key / f"host{host}.sock"


def start_keepers(run_dir: Path, n: int, resume: bool) -> list[Path]:
    """One keeper per host. Resuming, a keeper still alive from an earlier launch of this run is
    kept, with the snapshots it holds; a fresh run starts from empty keepers and no snapshots.
    Keepers are not children of the trainers (nor killed with the hosts' namespaces): each stands
    for its host's memory and outlives the trainer on it."""
    if not resume:
        stop_keepers(run_dir, n)
        shutil.rmtree(run_dir / "snapshots", ignore_errors=True)
    sockets = []
    for i in range(n):
        path = keeper_socket(run_dir, i)
        sockets.append(path)
        client = KeeperClient(path, timeout_s=2.0)
        if client.alive():
            client.adopt(os.getpid())
            continue
        log = (run_dir / "logs" / f"keeper{i}.log").open("ab")
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "geotrain.ft.keeper",
                "--socket",
                str(path),
                "--dir",
                str(run_dir / "snapshots"),
                "--linger",
                str(KEEPER_LINGER_S),
                "--parent-pid",
                str(os.getpid()),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
    for path in sockets:
        wait_ready(path)
    return sockets


def stop_keepers(run_dir: Path, n: int) -> None:
    """Ask this run's keepers to finish their disk writes and exit (and wait until they have)."""
    for i in range(n):
        path = keeper_socket(run_dir, i)
        client = KeeperClient(path, timeout_s=60.0)
        pid = 0
        with contextlib.suppress(KeeperError):
            pid = client.pid()
            client.stop()
        deadline = time.monotonic() + 10
        # Gone when its socket is gone and the process has exited (a zombie has no command line).
        while time.monotonic() < deadline and (path.exists() or _running(pid)):
            time.sleep(0.02)


def persist_keepers(sockets: list[Path], directory: Path) -> int | None:
    """A run that did not finish: every keeper writes the worker states it holds to disk (at
    once, each its own), so ``--resume`` works after the keepers are gone too. Returns the newest
    step every worker has on disk now, the one a resume from disk starts at, or None."""

    def persist(path: Path) -> None:
        with contextlib.suppress(KeeperError):  # one that cannot answer or write adds nothing
            KeeperClient(path, timeout_s=300.0).persist()

    threads = [threading.Thread(target=persist, args=(path,), daemon=True) for path in sockets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the step a resume from disk would choose (members and joiners counted as it counts them)
    try:
        return choose_step([availability(r, None, directory) for r in range(len(sockets))])[0]
    except NoCommonStep:
        return None


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def stop_lingering_keepers() -> list[Path]:
    """Stop the keepers of every run on this machine whose launcher is gone."""
    from geotrain.ft.keeper import _alive

    stopped = []
    for path in sorted((Path(tempfile.gettempdir()) / "geotrain-keepers").glob("*/host*.sock")):
        client = KeeperClient(path, timeout_s=5.0)
        try:
            parent = client.parent_pid()
        except KeeperError:
            continue
        if parent > 0 and _alive(parent):
            continue  # a live run's keeper
        with contextlib.suppress(KeeperError):
            client.stop()
            stopped.append(path)
    return stopped
