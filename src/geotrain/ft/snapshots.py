"""Snapshots off the critical path, and restoring a worker from the keeper, its peers or disk.

``Snapshotter.take`` runs on the training thread and pays only for the deep CPU copy of the
state (``ft.state.capture``); a background thread then frames it with its checksum, hands it to
this host's keeper (which writes a disk checkpoint from its copy when asked), and, with
redundancy on, sends the worker's unique state to its peers' keepers on the snapshot process
group. If the previous snapshot is still travelling when the next is due, the training thread
waits for it (the wait is counted): every worker takes the same snapshots in the same order, so
their redundancy exchanges always pair up.

``restore`` runs on every worker of a resumed run. The workers pool what they can reach (their
keeper's copies, their disk checkpoints, the pieces their keeper holds for others), agree on the
newest step every worker can be restored to, and load it: from the keeper's memory, else from
disk, else rebuilt from peers' pieces plus a survivor's shared state.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from geotrain.ft.keeper import KeeperClient, KeeperError, disk_path, disk_steps
from geotrain.ft.redundancy import Redundancy, exchange, parse_redundancy, recv_blob, send_blob
from geotrain.ft.state import CorruptSnapshot, decode, encode, join, split, write_atomic

KEEP_ON_DISK = 2


class ResumeError(RuntimeError):
    """A resume that cannot be done as asked; the message says why and what to do."""


@dataclass
class SnapshotConfig:
    every: int  # steps between snapshots (> 0)
    checkpoint_every: int = 0  # steps between disk checkpoints (0: only the final one)
    redundancy: str = "off"  # off | ring | ec:K/N
    rate_bps: float = 0.0  # pace of redundancy traffic (0: unpaced)
    keeper: str = ""  # the keeper's socket ("": disk checkpoints from a thread of the trainer)
    directory: Path | None = None  # where disk checkpoints go (None: no disk)


@dataclass
class SnapshotStats:
    taken: int = 0
    critical_s: float = 0.0  # on the training thread: the copy plus any wait for the previous one
    copy_s: float = 0.0
    background_s: float = 0.0
    full_bytes: int = 0
    unique_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class Snapshotter:
    def __init__(self, cfg: SnapshotConfig, rank: int, world_size: int, comm=None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.comm = comm  # a Communicator over the snapshot process group (redundancy traffic)
        self.scheme: Redundancy | None = (
            parse_redundancy(cfg.redundancy, world_size) if world_size > 1 else None
        )
        if self.scheme is not None and not cfg.keeper:
            raise ResumeError("--redundancy needs a keeper to hold peers' pieces (--keeper SOCKET)")
        self.client = KeeperClient(cfg.keeper) if cfg.keeper else None
        self.stats = SnapshotStats()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="geotrain-snapshots", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        ce = self.cfg.checkpoint_every
        return step % self.cfg.every == 0 or bool(ce and step % ce == 0)

    def take(self, step: int, capture, final: bool = False) -> None:
        """Copy the state now (``capture()``); store and replicate it in the background."""
        t0 = time.perf_counter()
        self._queue.join()  # the previous snapshot must have left (pairs redundancy exchanges)
        t1 = time.perf_counter()
        state = capture()
        self.stats.copy_s += time.perf_counter() - t1
        ce = self.cfg.checkpoint_every
        disk = final or bool(ce and step % ce == 0)
        self._queue.put((step, state, disk))
        self.stats.taken += 1
        self.stats.critical_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for every snapshot to be stored (and written, where asked), then stop the thread."""
        self._queue.join()
        self._queue.put(None)
        self._thread.join()
        if self.client is not None:
            try:
                self.client.flush()
            except KeeperError as e:
                self.stats.errors.append(str(e))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                t0 = time.perf_counter()
                self._store(*item)
                self.stats.background_s += time.perf_counter() - t0
            except Exception as e:  # a lost snapshot must not stop training; it is reported
                msg = f"snapshot at step {item[0]} not stored: {e}"
                self.stats.errors.append(msg)
                print(f"geotrain: rank {self.rank}: {msg}", file=sys.stderr, flush=True)
                if isinstance(e, (RuntimeError, dist.DistBackendError)) and self.scheme is not None:
                    self.scheme = None  # the snapshot group is broken; keep local snapshots
            finally:
                self._queue.task_done()

    def _store(self, step: int, state: dict[str, Any], disk: bool) -> None:
        blob = encode(state)
        self.stats.full_bytes = len(blob)
        if self.client is not None:
            self.client.put("full", self.rank, step, blob, disk=disk, commit=self.scheme is None)
        elif disk and self.cfg.directory is not None:
            write_atomic(disk_path(self.cfg.directory, self.rank, step), blob)
            for old in disk_steps(self.cfg.directory, self.rank)[:-KEEP_ON_DISK]:
                disk_path(self.cfg.directory, self.rank, old).unlink(missing_ok=True)
        if self.scheme is None or self.comm is None:
            return
        _, unique = split(state)
        unique_blob = encode(unique)
        self.stats.unique_bytes = len(unique_blob)
        pieces = self.scheme.pieces(unique_blob, self.rank, step)
        received = exchange(self.comm, self.scheme, pieces, self.cfg.rate_bps)
        assert self.client is not None
        for j, piece in enumerate(received):
            owner = (self.rank - 1 - j) % self.world_size
            self.client.put("piece", owner, step, piece, index=j, k=self.scheme.k, n=self.scheme.n)
        # Every worker's pieces are with their holders: only now may older snapshots go.
        self.comm.barrier()
        self.client.commit(self.rank, step)


# -- restoring ---------------------------------------------------------------------------------
def availability(rank: int, keeper: KeeperClient | None, directory: Path | None) -> dict[str, Any]:
    """What this worker can reach: its full states (keeper, disk) and pieces held for others."""
    out: dict[str, Any] = {"keeper": [], "disk": [], "pieces": []}
    if keeper is not None:
        try:
            for item in keeper.items():
                if item["kind"] == "full" and item["owner"] == rank:
                    out["keeper"].append(item["step"])
                elif item["kind"] == "piece":
                    out["pieces"].append([item["owner"], item["step"], item["index"], item["k"], item["n"]])
        except KeeperError:
            pass  # a keeper that is gone holds nothing
    if directory is not None:
        out["disk"] = disk_steps(directory, rank)
    return out


def _pieces_for(avail: list[dict[str, Any]], owner: int, step: int) -> list[tuple[int, int, int, int]]:
    """(holder, index, k, n) of the pieces of ``owner``'s state at ``step`` that survivors hold."""
    return [
        (holder, idx, k, n)
        for holder, a in enumerate(avail)
        for (o, s, idx, k, n) in a["pieces"]
        if o == owner and s == step and holder != owner
    ]


def restorable(avail: list[dict[str, Any]], step: int) -> dict[int, str] | None:
    """How each worker gets its state at ``step`` (keeper, disk or peers), or None if one cannot."""
    donors = [r for r, a in enumerate(avail) if step in a["keeper"] or step in a["disk"]]
    how: dict[int, str] = {}
    for r, a in enumerate(avail):
        if step in a["keeper"]:
            how[r] = "keeper"
        elif step in a["disk"]:
            how[r] = "disk"
        else:
            pieces = _pieces_for(avail, r, step)
            if not donors or not pieces or len({p[1] for p in pieces}) < pieces[0][2]:
                return None
            how[r] = "peers"
    return how


def choose_step(avail: list[dict[str, Any]], requested: int = 0) -> tuple[int, dict[int, str]]:
    """The newest step at which every worker can be restored (or ``requested``)."""
    steps = sorted({s for a in avail for s in a["keeper"] + a["disk"]}, reverse=True)
    if requested:
        how = restorable(avail, requested)
        if how is None:
            raise ResumeError(
                f"no way to restore every worker at step {requested}; restorable steps: "
                + (", ".join(str(s) for s in steps if restorable(avail, s)) or "none")
            )
        return requested, how
    for s in steps:
        how = restorable(avail, s)
        if how is not None:
            return s, how
    held = "; ".join(
        f"rank {r}: {sorted(set(a['keeper'] + a['disk'])) or 'nothing'}" for r, a in enumerate(avail)
    )
    raise ResumeError(f"no step at which every worker's state can be restored ({held})")


def restore(
    rank: int,
    world_size: int,
    keeper: KeeperClient | None,
    directory: Path | None,
    comm=None,
    requested: int = 0,
) -> tuple[dict[str, Any], str]:
    """This worker's state at the newest step every worker can reach, and where it came from.

    Collective over ``comm`` (the snapshot group) when there are several workers."""
    mine = availability(rank, keeper, directory)
    avail = [mine] if world_size == 1 else comm.all_gather_object(mine)
    step, how = choose_step(avail, requested)
    state, error = None, ""
    if how[rank] != "peers":
        try:
            if how[rank] == "keeper":
                try:
                    blob = keeper.get("full", rank, step)
                except KeeperError:
                    how[rank] = "disk"
            if how[rank] == "disk":
                blob = disk_path(directory, rank, step).read_bytes()
            state = decode(blob, f"rank {rank}'s snapshot at step {step} ({how[rank]})")
        except (CorruptSnapshot, OSError) as e:
            error = str(e)
    errors = [error] if world_size == 1 else comm.all_gather_object(error)
    bad = [e for e in errors if e]
    if bad:
        older = [s for s in sorted({s for a in avail for s in a["keeper"] + a["disk"]}) if s < step]
        good = [s for s in reversed(older) if restorable(avail, s)]
        hint = (
            f"the previous good snapshot is step {good[0]} (--resume-step {good[0]})"
            if good
            else "no older one"
        )
        raise ResumeError(f"{bad[0]}; {hint}")
    for owner in sorted(r for r, h in how.items() if h == "peers"):
        donor = min(r for r, h in how.items() if h != "peers")
        pieces = _pieces_for(avail, owner, step)
        if rank == donor:
            shared, _ = split(state)
            send_blob(comm, encode(shared), owner)
        for holder, idx, _, _ in pieces:
            if rank == holder:
                send_blob(comm, keeper.get("piece", owner, step, idx), owner)
        if rank == owner:
            shared = decode(recv_blob(comm, donor), f"rank {donor}'s shared state")
            framed = [recv_blob(comm, holder) for holder, _, _, _ in pieces]
            _, _, k, n = pieces[0]
            scheme = Redundancy(k, n, f"ec:{k}/{n}")
            try:
                unique = decode(scheme.rebuild(framed), f"rank {owner}'s rebuilt state")
                state = join(unique, shared)
            except CorruptSnapshot as e:
                error = str(e)
    errors = [error] if world_size == 1 else comm.all_gather_object(error)
    if any(errors):
        raise ResumeError(next(e for e in errors if e))
    return state, how[rank]


def preflight(
    keepers: list[KeeperClient | None], directory: Path, requested: int = 0
) -> tuple[int, dict[int, str]]:
    """Before a resumed run starts: the step to restore and each worker's source, with every full
    state it will read verified (checksum) now, so a bad snapshot is refused before anything runs."""
    from geotrain.ft.state import verify

    avail = [availability(r, k, directory) for r, k in enumerate(keepers)]
    step, how = choose_step(avail, requested)
    for r, source in how.items():
        if source == "peers":
            continue
        blob = b""
        if source == "keeper":
            try:
                blob = keepers[r].get("full", r, step)
            except KeeperError:
                source = "disk"
        if source == "disk":
            path = disk_path(directory, r, step)
            blob = path.read_bytes() if path.exists() else b""
        if not verify(blob):
            older = sorted({s for a in avail for s in a["keeper"] + a["disk"] if s < step}, reverse=True)
            good = [s for s in older if restorable(avail, s)]
            hint = (
                f"the previous good snapshot is step {good[0]} (--resume-step {good[0]})"
                if good
                else "there is no older one"
            )
            where = "keeper memory" if source == "keeper" else str(disk_path(directory, r, step))
            raise ResumeError(
                f"rank {r}'s snapshot at step {step} ({where}) is truncated or fails its checksum; {hint}"
            )
    return step, how
