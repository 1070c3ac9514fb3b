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

import contextlib
import mmap
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from geotrain.compress.codec import ConfigError
from geotrain.ft.keeper import (
    KeeperClient,
    KeeperError,
    disk_members,
    disk_path,
    disk_steps,
    members_path,
    prune_disk,
    write_disk_snapshot,
)
from geotrain.ft.redundancy import Redundancy, exchange, parse_redundancy, recv_blob, send_blob
from geotrain.ft.state import (
    CorruptSnapshot,
    decode,
    decode_memfd,
    encode,
    encode_to_memfd,
    handed_over,
    join,
    new_memfd,
    seal_memfd,
    split,
)

KEEP_ON_DISK = 2


class ResumeError(RuntimeError):
    """A resume that cannot be done as asked; the message says why and what to do."""


class NoCommonStep(ResumeError):
    """No step at which every worker's state can be restored (each may hold some)."""


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
    recycled: int = 0  # snapshots written into the memory file of one the keeper let go
    errors: list[str] = field(default_factory=list)
    # (step, seconds waiting for the previous one and agreeing to ship, seconds copying) each
    each: list[tuple[int, float, float]] = field(default_factory=list)


class Route(NamedTuple):
    """Where a snapshot ships, fixed when its members agree to ship it (a regroup may come
    before it is stored): the epoch generation, the snapshot group, the scheme, the hosts."""

    gen: int
    comm: Any
    scheme: Redundancy | None
    members: list[int] | None
    redundant: bool


class Snapshotter:
    """Takes snapshots on the training thread, stores them in one background thread and ships
    redundancy in another.

    With a keeper, the training thread serialises the state straight into an anonymous memory file
    (``memfd``): that is the snapshot's only copy. The store thread seals it (length and CRC32)
    and passes the descriptor to the keeper over its socket, so the keeper holds those very pages
    and no byte crosses the socket. Without a keeper only disk snapshots are taken (a CPU copy,
    then framed and written by the store thread).

    Shipping a worker's unique state to its peers takes as long as the link needs (86 MB of
    AdamW moments for the ``mini`` model: 7 s at 100 Mbit/s), so it is skipped for a snapshot if
    the previous one is still travelling on any worker; the workers agree on that with one small
    all-reduce on the training group (``control``), so their exchanges always pair up. Training
    never waits for it.
    """

    def __init__(
        self, cfg: SnapshotConfig, rank: int, world_size: int, comm=None, control=None, size_hint: int = 0
    ) -> None:
        self.cfg = cfg
        self.rank = rank  # this host's id: the owner named on its snapshots and pieces
        self.comm = comm  # a Communicator over the snapshot process group (redundancy traffic)
        self.control = control  # the training group's Communicator: agreeing to ship
        self.members: list[int] | None = None  # after a membership change: the epoch's hosts
        self.scheme: Redundancy | None = (
            parse_redundancy(cfg.redundancy, world_size) if world_size > 1 else None
        )
        if self.scheme is not None and not cfg.keeper:
            raise ResumeError("--redundancy needs a keeper to hold peers' pieces (--keeper SOCKET)")
        if comm is None:  # a joiner before its admission: no group to ship on yet
            self.scheme = None
        self._retired: list = []  # snapshot groups of earlier epochs (never freed: see regroup)
        self._gen = 0  # the membership epochs seen: a shipment of an older one is left alone
        self._lock = threading.Lock()
        self.client = KeeperClient(cfg.keeper) if cfg.keeper else None
        self.stats = SnapshotStats()
        # Decided once and the same on every worker: whether shipments are agreed on at all.
        self.redundant = self.scheme is not None
        self.shipped: list[int] = []  # steps whose unique state reached the peers
        self._shipping = False
        self._next_fd: int | None = None  # the next snapshot's memory file, its pages allocated
        self._next_recycled = False  # whether that file is one the keeper handed back
        self._shipping_files: set[int] = set()  # inodes of memory files the shipping thread reads
        self._size_hint = size_hint
        self._store_queue: queue.Queue = queue.Queue()
        self._ship_queue: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._store_queue, self._store), daemon=True),
            threading.Thread(target=self._loop, args=(self._ship_queue, self._ship), daemon=True),
        ]
        for t in self._threads:
            t.start()
        if self.client is not None and size_hint:
            self._store_queue.put((0, None, False, False, None, None))  # prepares the first one's memory

    def due(self, step: int) -> bool:
        ce = self.cfg.checkpoint_every
        if bool(ce and step % ce == 0):
            return True
        # Without a keeper an in-memory snapshot has nowhere to live: only disk ones are taken.
        return self.client is not None and step % self.cfg.every == 0

    def regroup(self, comm, members: list[int]) -> None:
        """The membership changed: redundancy goes on among ``members`` (host ids, in the new
        epoch's rank order) over ``comm``, the new epoch's snapshot group (None: it stops).
        A shipment still under way on the old group may wait for a lost peer forever: it is left
        to its thread, and a fresh thread ships from now on. Every member (a joiner too) calls
        this at the same regroup, so they agree on what they ship."""
        self._store_queue.join()  # the old epoch's snapshots are with the keeper (local work)
        with self._lock:  # a failed old shipment must not switch off what is decided here
            self._regroup(comm, members)

    def _regroup(self, comm, members: list[int]) -> None:
        self._gen += 1
        if self._shipping:
            self._shipping = False
            self._ship_queue = queue.Queue()
            thread = threading.Thread(target=self._loop, args=(self._ship_queue, self._ship), daemon=True)
            self._threads[1] = thread  # the old one is left alone (daemon)
            thread.start()
        if self.comm is not None:
            self._retired.append(self.comm)  # freeing a gloo group may join a stuck thread
        self.comm, self.members = comm, list(members)
        self.scheme = None
        if comm is not None and len(members) > 1 and self.cfg.redundancy != "off":
            try:
                self.scheme = parse_redundancy(self.cfg.redundancy, len(members))
            except ConfigError as e:  # e.g. ec:2/3 on 3 members: none until more are back
                print(f"geotrain: host {self.rank}: redundancy off for now: {e}", file=sys.stderr, flush=True)
        self.redundant = self.scheme is not None

    def sent_bytes(self) -> int:
        """Redundancy bytes sent, over every epoch's snapshot group."""
        return sum(c.stats.sent_bytes for c in [*self._retired, self.comm] if c is not None)

    def take(self, step: int, capture, final: bool = False, members: list[int] | None = None) -> None:
        """Snapshot now: ``capture(copy)`` gives the state (live tensors when ``copy`` is False);
        it is stored, and maybe shipped, in the background. ``members``: the hosts training
        together now, after a membership change (None: every host of the first epoch)."""
        t0 = time.perf_counter()
        self._store_queue.join()  # the previous one is with the keeper: at most one in flight
        ship = False
        if self.redundant:
            # Skipped if any worker is still shipping the previous one, or has given up shipping
            # (its keeper or the snapshot group failed): every worker decides the same.
            busy = [float(self._shipping or self.scheme is None)]
            ship = not (self.control.max_scalars(busy)[0] if self.control is not None else busy[0])
        ce = self.cfg.checkpoint_every
        disk = final or bool(ce and step % ce == 0)
        t1 = time.perf_counter()
        if self.client is not None:
            fd, self._next_fd = self._next_fd, None
            self.stats.recycled += bool(fd is not None and self._next_recycled)
            snapshot = encode_to_memfd(capture(False), f"geotrain-rank{self.rank}", fd)
        else:
            snapshot = capture(True)
        self.stats.copy_s += time.perf_counter() - t1
        if ship:
            self._shipping = True
        # Where it ships is decided now, with the agreement: a regroup may come before it is stored.
        route = Route(self._gen, self.comm, self.scheme, self.members, self.redundant)
        self._store_queue.put((step, snapshot, disk, ship, members, route))
        self.stats.taken += 1
        self.stats.critical_s += time.perf_counter() - t0
        self.stats.each.append((step, round(t1 - t0, 4), round(time.perf_counter() - t1, 4)))

    def wait_stored(self) -> None:
        """Until every snapshot taken is with the keeper (or on disk); shipments may still travel."""
        self._store_queue.join()

    def wait(self) -> None:
        """Until every snapshot taken is stored and every shipment has arrived (one left on a
        group that lost a member is not waited for)."""
        self._store_queue.join()
        self._ship_queue.join()  # after a regroup, a fresh queue: the old one is not waited for

    def close(self) -> None:
        """Wait for every snapshot to be stored (and written, where asked) and every shipment to
        arrive, then stop the threads."""
        self.wait()
        self._store_queue.put(None)
        self._ship_queue.put(None)
        for t in self._threads:
            t.join()
        if self._next_fd is not None:
            os.close(self._next_fd)
            self._next_fd = None
        if self.client is not None:
            try:
                self.client.flush()
            except KeeperError as e:
                self.stats.errors.append(str(e))

    def _loop(self, work: queue.Queue, handle) -> None:
        while True:
            item = work.get()
            try:
                if item is None:
                    return
                t0 = time.perf_counter()
                handle(*item)
                self.stats.background_s += time.perf_counter() - t0
            except Exception as e:  # a lost snapshot must not stop training; it is reported
                shipping = handle == self._ship
                msg = f"snapshot at step {item[0]} not {'shipped' if shipping else 'stored'}: {e}"
                self.stats.errors.append(msg)
                print(f"geotrain: rank {self.rank}: {msg}", file=sys.stderr, flush=True)
                with self._lock:
                    route = item[-1]
                    stale = route is not None and route.gen != self._gen  # an earlier epoch's
                    if (shipping or item[3]) and not stale:  # a failed store never queued its shipment
                        self.scheme = None  # keep local snapshots; peers learn it at the next take
                        self._shipping = False
            finally:
                work.task_done()

    def _store(
        self, step: int, snapshot, disk: bool, ship: bool, members: list[int] | None, route: Route | None
    ) -> None:
        if snapshot is None:  # nothing to store yet: allocate the first snapshot's pages
            self._next_fd = new_memfd(f"geotrain-rank{self.rank}", self._size_hint)
            return
        if self.client is None:  # a CPU copy, for disk
            blob = encode(snapshot)
            self.stats.full_bytes = len(blob)
            self._write_disk(step, blob, members)
            return
        fd, size = snapshot
        spares: list[int] = []
        try:
            seal_memfd(fd, size)
            self.stats.full_bytes = size
            try:
                # Without redundancy a snapshot is complete once the keeper has it. The keeper hands
                # back the file of one it let go: the next snapshot is written into its pages.
                spares = self.client.put_fd(
                    "full", self.rank, step, fd, size, disk=disk, commit=not route.redundant, pending=ship,
                    members=members, recycle=True,
                )  # fmt: skip
            except KeeperError as e:
                if not self.stats.errors:
                    print(f"geotrain: rank {self.rank}: {e}; snapshots go to disk", file=sys.stderr)
                self.stats.errors.append(f"step {step}: {e}")
                if disk:
                    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
                        self._write_disk(step, mm, members)
            if ship:
                shipped = os.dup(fd)
                with self._lock:  # read by the shipping thread: never written into before it is done
                    self._shipping_files.add(os.fstat(shipped).st_ino)
                self._ship_queue.put((step, shipped, size, route))
        except BaseException:
            for spare in spares:
                os.close(spare)
            raise
        finally:
            os.close(fd)
        self._next_fd = self._next_file(spares, size + (1 << 20))

    def _next_file(self, spares: list[int], reserve: int) -> int:
        """The memory file the next snapshot is written into: one the keeper handed back
        (``spares``: its pages written before, so the copy pays no first touch), else a new one
        (its pages allocated here; they are zeroed, and on a virtual machine faulted in, at the
        copy's first write: ``ft.state.new_memfd``). The others, and one the shipping thread
        still reads, are closed."""
        reuse = None
        with self._lock:
            for fd in spares:
                if reuse is None and os.fstat(fd).st_ino not in self._shipping_files:
                    reuse = fd
                else:
                    os.close(fd)
        if reuse is not None:
            try:
                os.posix_fallocate(reuse, 0, reserve)  # only what the file lacks is allocated
                self._next_recycled = True
                return reuse
            except OSError:
                os.close(reuse)
        self._next_recycled = False
        return new_memfd(f"geotrain-rank{self.rank}", reserve)

    def _done_reading(self, fd: int) -> None:
        """The shipping thread is done with a snapshot's file: it may be written into again."""
        with self._lock:
            self._shipping_files.discard(os.fstat(fd).st_ino)
        os.close(fd)

    def _write_disk(self, step: int, blob, members: list[int] | None = None) -> None:
        if self.cfg.directory is None:
            return
        write_disk_snapshot(self.cfg.directory, self.rank, step, blob, members)
        prune_disk(self.cfg.directory, self.rank, KEEP_ON_DISK)

    def _ship(self, step: int, fd: int, size: int, route: Route) -> None:
        gen, comm, scheme, members, _ = route
        try:
            if scheme is None or comm is None or self.client is None:
                return
            try:
                state = decode_memfd(fd, size, f"rank {self.rank}'s snapshot at step {step}")
            finally:
                self._done_reading(fd)
                fd = -1
            _, unique = split(state)
            del state
            unique_blob = encode(unique)
            self.stats.unique_bytes = len(unique_blob)
            pieces = scheme.pieces(unique_blob, self.rank, step)
            received = exchange(comm, scheme, pieces, self.cfg.rate_bps)
            ok = 1.0
            try:
                for j, piece in enumerate(received):
                    sender = (comm.rank - 1 - j) % comm.world_size  # its rank in the group
                    owner = members[sender] if members is not None else sender
                    self.client.put("piece", owner, step, piece, index=j, k=scheme.k, n=scheme.n)
            except KeeperError as e:
                self.stats.errors.append(f"step {step}: {e}")
                ok = 0.0
            # Every worker's pieces are with their holders: only now may older snapshots go. All
            # workers learn together whether that is so (a barrier that cannot be left halfway).
            if comm.mean_scalars([ok])[0] < 1.0:
                raise KeeperError(f"a keeper did not take its pieces of step {step}; redundancy is off")
            self.client.commit(self.rank, step)
            self.shipped.append(step)
        finally:
            if fd >= 0:
                self._done_reading(fd)
            with self._lock:
                if gen == self._gen:  # a shipment of an earlier epoch says nothing about this one
                    self._shipping = False


# -- restoring ---------------------------------------------------------------------------------
def availability(rank: int, keeper: KeeperClient | None, directory: Path | None) -> dict[str, Any]:
    """What this worker can reach: its full states (keeper, disk) and pieces held for others, and
    for a state taken after a membership change, the hosts that were training together then."""
    out: dict[str, Any] = {"keeper": [], "disk": [], "pieces": [], "members": {}}
    if keeper is not None:
        try:
            for item in keeper.items():
                if item["kind"] == "full" and item["owner"] == rank:
                    out["keeper"].append(item["step"])
                    if item.get("members") is not None:
                        out["members"][item["step"]] = list(item["members"])
                elif item["kind"] == "piece":
                    out["pieces"].append([item["owner"], item["step"], item["index"], item["k"], item["n"]])
        except KeeperError:
            pass  # a keeper that is gone holds nothing
    if directory is not None:
        out["disk"] = disk_steps(directory, rank)
        for step in out["disk"]:
            members = disk_members(directory, rank, step)
            if members is not None:
                out["members"].setdefault(step, members)
    return out


def members_at(avail: list[dict[str, Any]], step: int) -> list[int]:
    """The hosts that were training together at ``step``, as the states taken there say: every
    host, unless all of them were taken after a membership change (then the union of what they
    recorded, so that holders who disagree fall back to an older step rather than guess)."""
    holders = [a for a in avail if step in a["keeper"] or step in a["disk"]]
    if not holders or any(step not in a.get("members", {}) for a in holders):
        return list(range(len(avail)))
    return sorted({h for a in holders for h in a["members"][step]})


def _pieces_for(avail: list[dict[str, Any]], owner: int, step: int) -> list[tuple[int, int, int, int]]:
    """(holder, index, k, n) of the pieces of ``owner``'s state at ``step`` that survivors hold."""
    return [
        (holder, idx, k, n)
        for holder, a in enumerate(avail)
        for (o, s, idx, k, n) in a["pieces"]
        if o == owner and s == step and holder != owner
    ]


def restorable(avail: list[dict[str, Any]], step: int) -> dict[int, str] | None:
    """How each worker gets its state at ``step`` (keeper, disk or peers), or None if one cannot.

    A host that was not training at ``step`` (lost before it under ``--on-failure continue``, and
    not replaced) comes back as a joiner would have been admitted: ``member``, the model and
    algorithm state of a host that was, with its own optimizer and data stream fresh."""
    members = members_at(avail, step)
    donors = [r for r, a in enumerate(avail) if step in a["keeper"] or step in a["disk"]]
    how: dict[int, str] = {}
    for r, a in enumerate(avail):
        if step in a["keeper"]:
            how[r] = "keeper"
        elif step in a["disk"]:
            how[r] = "disk"
        elif r not in members:
            if not donors:
                return None
            how[r] = "member"
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
    raise NoCommonStep(f"no step at which every worker's state can be restored ({held})")


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
    needy = sorted(r for r, h in how.items() if h == "peers")
    rebuilt = sorted(r for r, h in how.items() if h == "member")
    state, error = None, ""
    to_send: dict[int, list[tuple[int, bytes]]] = {}  # owner -> [(position, blob)] this rank sends
    admission = b""  # a member's state, for those rebuilt from it
    try:
        source = how[rank]
        if source == "keeper":
            try:
                blob = keeper.get("full", rank, step)
            except KeeperError:
                source = "disk"
        if source == "disk":
            blob = disk_path(directory, rank, step).read_bytes()
        if source in ("keeper", "disk"):
            state = decode(blob, f"rank {rank}'s snapshot at step {step} ({source})")
        # Fetch now what this rank will send, so a failure is known to all before any transfer.
        for owner in needy:
            donor = min(r for r, h in how.items() if h in ("keeper", "disk"))
            if rank == donor:
                to_send.setdefault(owner, []).append((-1, encode(split(state)[0])))
            for pos, (holder, idx, _, _) in enumerate(_pieces_for(avail, owner, step)):
                if rank == holder:
                    to_send.setdefault(owner, []).append((pos, keeper.get("piece", owner, step, idx)))
        if rebuilt and rank == min(r for r, h in how.items() if h in ("keeper", "disk")):
            admission = encode(admitted_state(state))
    except Exception as e:  # every rank must learn of it, or the others wait on a transfer
        error = str(e) or type(e).__name__
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
    # Each lost worker in turn receives a survivor's shared state, then its pieces in order; a
    # rank that is both donor and holder sends in that same order.
    for owner in needy:
        donor = min(r for r, h in how.items() if h in ("keeper", "disk"))
        pieces = _pieces_for(avail, owner, step)
        for _, blob in sorted(to_send.get(owner, [])):
            send_blob(comm, blob, owner)
        if rank == owner:
            try:
                shared = decode(recv_blob(comm, donor), f"rank {donor}'s shared state")
                framed = [recv_blob(comm, holder) for holder, _, _, _ in pieces]
                _, _, k, n = pieces[0]
                unique = decode(
                    Redundancy(k, n, f"ec:{k}/{n}").rebuild(framed), f"rank {owner}'s rebuilt state"
                )
                state = join(unique, shared)
            except CorruptSnapshot as e:
                error = str(e)
    # Hosts that were not training at this step get a member's state, as a joiner is admitted.
    for owner in rebuilt:
        donor = min(r for r, h in how.items() if h in ("keeper", "disk"))
        if rank == donor:
            send_blob(comm, admission, owner)
        if rank == owner:
            try:
                state = decode(recv_blob(comm, donor), f"rank {donor}'s state at step {step}")
            except CorruptSnapshot as e:
                error = str(e)
    errors = [error] if world_size == 1 else comm.all_gather_object(error)
    if any(errors):
        raise ResumeError(next(e for e in errors if e))
    drop_after(rank, step, keeper, directory)
    return state, how[rank]


def drop_after(rank: int, step: int, keeper: KeeperClient | None, directory: Path | None) -> None:
    """A run resumed at ``step`` drops this worker's snapshots past it, as it drops its metrics:
    they belong to a future that will not happen, and would outrank the new ones (a keeper keeps
    the newest steps, and a later resume takes the newest)."""
    if keeper is not None:  # its own states and what it holds for others (flushed to disk first)
        with contextlib.suppress(KeeperError):
            keeper.drop_after(step)
    if directory is not None:
        for s in disk_steps(directory, rank):
            if s > step:
                disk_path(directory, rank, s).unlink(missing_ok=True)
                members_path(directory, rank, s).unlink(missing_ok=True)


def admitted_state(state: dict[str, Any]) -> dict[str, Any]:
    """What a host that was not training at a snapshot's step gets from one that was: what a
    joiner is handed at its admission (``ft/handover.py``): the model and the algorithm's state,
    the optimizer only where every worker's is the same, and the progress (step, time). Its codec
    residuals, random streams and (under the local methods) optimizer start fresh."""
    keep = [*handed_over("optimizer" in state["shared"]), "progress"]
    return {
        "step": state["step"],
        "parts": {p: state["parts"][p] for p in keep if p in state["parts"]},  # (older: no codec_shared)
        "shared": [],
        "admitted": True,
    }


def preflight(
    keepers: list[KeeperClient | None], directory: Path, requested: int = 0, check: bool = True
) -> tuple[int, dict[int, str]]:
    """Before a resumed run starts: the step to restore and each worker's source, with every full
    state it will read verified (checksum) now, so a bad snapshot is refused before anything runs.
    ``check=False`` (a rollback, where seconds count) leaves the checksums to the trainers."""
    from geotrain.ft.state import verify

    avail = [availability(r, k, directory) for r, k in enumerate(keepers)]
    step, how = choose_step(avail, requested)
    for r, source in how.items() if check else ():
        if source in ("peers", "member"):
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
