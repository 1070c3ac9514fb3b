"""The keeper: a process per host that holds snapshots in its own memory and outlives the trainer.

In-memory checkpointing (Wang et al., arXiv 2310.12670; GEMINI, SOSP 2023): a trainer hands each
snapshot to a process that is not its child, so a crashed or killed trainer loses nothing that
was handed over, and a restarted one restores from memory instead of disk. The keeper holds:

- ``full``: its host's workers' whole states (the last ``keep`` steps of each);
- ``piece``: copies or erasure-coded stripes of *other* hosts' unique state (``ft.redundancy``),
  so that a host that vanished with its keeper can be rebuilt from its peers;

and writes disk checkpoints from its own copy, in a background thread, when a ``put`` asks for
one (``--checkpoint-every``), so the trainer's critical path never waits on the disk.

A worker's state arrives as a memory file (``put_fd``) whose pages the keeper maps. When such a
snapshot is let go and its worker asked for recycling, its file goes back to the worker with the
reply to the worker's next ``put_fd`` (once nothing here reads it: no disk write, no ``get``
under way), and the worker writes a later snapshot into those pages (unless its own shipping
thread still reads that file: ``ft.snapshots``). Fresh pages cost a first touch each: zeroing by
the kernel, and on a virtual machine that returns freed memory to its host (free page
reporting) a fault in the hypervisor too, about 1 s for the ``mini`` model's 229 MB here, paid
on the training thread. The keeper never reads a file it handed back.

It holds its copies in its own memory, never in ``/dev/shm`` (shared by every namespace on one
machine, so removing an emulated host would not lose them). It speaks a tiny protocol on a Unix
socket (a JSON header line's length, the header, then ``size`` payload bytes), which works across
network namespaces because the socket is a file. ``geotrain run`` starts one per host; on a real
machine run ``geotrain keeper --socket PATH --dir DIR`` beside ``torchrun`` and pass the same
``--keeper PATH`` to the trainer. A keeper whose launcher is gone exits after ``--linger`` idle
seconds, so a failed run's snapshots wait in memory for ``geotrain run --resume``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import queue
import re
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geotrain.ft.atomic import write_atomic

_LEN = struct.Struct("<I")
KEEP_STEPS = 2


def disk_path(directory: Path, owner: int, step: int) -> Path:
    return Path(directory) / f"rank{owner}" / f"step{step:08d}.snap"


def members_path(directory: Path, owner: int, step: int) -> Path:
    """The hosts that were training together when a disk snapshot was taken (written only after a
    membership change: without it, a snapshot is the first epoch's, every host a member)."""
    return Path(directory) / f"rank{owner}" / f"step{step:08d}.members"


def write_disk_snapshot(directory: Path, owner: int, step: int, blob, members: list[int] | None) -> None:
    """A disk snapshot, atomically, with its members beside it (written first, so a complete
    snapshot never lacks them)."""
    if members is not None:
        write_atomic(members_path(directory, owner, step), json.dumps(members).encode())
    else:  # an earlier launch's snapshot of this step may have had other members
        members_path(directory, owner, step).unlink(missing_ok=True)
    write_atomic(disk_path(directory, owner, step), blob)


def prune_disk(directory: Path, owner: int, keep: int) -> None:
    for old in disk_steps(directory, owner)[:-keep]:
        disk_path(directory, owner, old).unlink(missing_ok=True)
        members_path(directory, owner, old).unlink(missing_ok=True)


def disk_members(directory: Path, owner: int, step: int) -> list[int] | None:
    try:
        return [int(h) for h in json.loads(members_path(directory, owner, step).read_text())]
    except (OSError, ValueError, TypeError):
        return None


def disk_steps(directory: Path, owner: int) -> list[int]:
    """Steps of the disk snapshots of worker ``owner`` (complete files only: writes are atomic)."""
    folder = Path(directory) / f"rank{owner}"
    if not folder.is_dir():
        return []
    found = (re.fullmatch(r"step(\d+)\.snap", p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


class KeeperError(RuntimeError):
    pass


# -- wire ------------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _send(
    sock: socket.socket,
    header: dict[str, Any],
    payload: bytes | memoryview = b"",
    fds: list[int] | None = None,
) -> None:
    header = dict(header, size=len(payload))
    data = json.dumps(header).encode()
    message = _LEN.pack(len(data)) + data
    if fds:  # the descriptors travel with the first bytes
        sent = socket.send_fds(sock, [message], fds)
        message = message[sent:]
    if message:  # an empty send to a peer that has already answered and closed is EPIPE
        sock.sendall(message)
    if len(payload):
        sock.sendall(payload)


def _recv_with_fds(sock: socket.socket) -> tuple[dict[str, Any], bytes | bytearray, list[int]]:
    """A message, with any file descriptors that came with its first bytes (SCM_RIGHTS)."""
    first, fds, _, _ = socket.recv_fds(sock, _LEN.size, 4)
    try:
        if not first:
            raise ConnectionError("peer closed the connection")
        head = bytes(first) + (
            bytes(_recv_exact(sock, _LEN.size - len(first))) if len(first) < _LEN.size else b""
        )
        (n,) = _LEN.unpack(head)
        header = json.loads(_recv_exact(sock, n))
        payload = _recv_exact(sock, header["size"]) if header["size"] else b""  # kept as received
    except BaseException:
        for fd in fds:  # descriptors that came with a message never read whole
            os.close(fd)
        raise
    return header, payload, list(fds)


# -- server ----------------------------------------------------------------------------------
@dataclass(eq=False)  # each one is itself: let go by identity
class _Held:
    """One item a keeper holds: what ``list`` reports of it (``meta``), its bytes, and for a
    ``put_fd`` the memory file they map, with whether its worker takes let-go files back and how
    many read it now (the disk writer, a ``get``, ``persist``: its file is not handed back
    meanwhile)."""

    meta: dict[str, Any]
    blob: Any  # bytes, or an mmap of ``fd``
    fd: int | None = None
    recycle: bool = False
    readers: int = 0

    def unmap(self) -> None:
        with contextlib.suppress(BufferError):  # a view still out: the mapping goes with it
            self.blob.close()

    def release(self) -> None:
        self.unmap()
        if self.fd is not None:
            os.close(self.fd)


class Keeper:
    """The store behind the socket: blobs by (kind, owner, step, index), the newest steps kept."""

    def __init__(self, directory: Path | None, keep: int = KEEP_STEPS) -> None:
        self.directory = Path(directory) if directory else None
        self.keep = keep
        self._blobs: dict[tuple[str, int, int, int], _Held] = {}
        self._spares: dict[int, list[_Held]] = {}  # let go, their files to hand back, by owner
        self._lock = threading.Lock()
        self._disk: queue.Queue = queue.Queue()
        self.last_request = time.monotonic()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()

    def put(self, header: dict[str, Any], blob: bytes, fd: int | None = None) -> None:
        """Hold ``blob``; ``fd``: the memory file it maps (``put_fd``), kept to be handed back."""
        key = (header["kind"], int(header["owner"]), int(header["step"]), int(header.get("index", 0)))
        meta = {k: header[k] for k in ("kind", "owner", "step", "index", "k", "n", "members") if k in header}
        meta["committed"] = bool(header.get("commit"))
        # Being shipped to the peers: it may become the newest complete step, so it stays.
        meta["pending"] = bool(header.get("pending")) and not meta["committed"]
        disk = bool(header.get("disk")) and self.directory is not None and key[0] == "full"
        # the disk writer reads it from here: its file is not handed back before
        held = _Held(meta, blob, fd, recycle=bool(header.get("recycle")), readers=int(disk))
        with self._lock:
            if key in self._blobs:  # the same step again (a resumed run): the old one is let go
                self._let_go(key)
            self._blobs[key] = held
            self._prune(key[0], key[1])
        if disk:
            self._disk.put((key[1], key[2], held))

    def _unpin(self, held: _Held) -> None:
        with self._lock:
            held.readers -= 1

    def _let_go(self, key: tuple[str, int, int, int]) -> None:
        """Forget a held item (under the lock). The memory file behind it waits to go back where
        its worker takes files back; otherwise its pages are freed once nothing reads them."""
        held = self._blobs.pop(key)
        if held.fd is None:
            return
        if not held.recycle:
            os.close(held.fd)  # the mapping goes with its last reader
            return
        waiting = self._spares.setdefault(key[1], [])
        waiting.append(held)
        # One free file to hand back is enough: a worker writes one snapshot at a time.
        free = [h for h in waiting if not h.readers]
        for extra in free[:-1]:
            waiting.remove(extra)
            extra.release()

    def spare_files(self, owner: int) -> list[int]:
        """The memory file of one of ``owner``'s snapshots let go and read by nobody now (none if
        there is none), for the worker to write its next snapshot into; any other free one is
        closed. The caller sends it and closes its descriptor."""
        with self._lock:
            waiting = self._spares.pop(owner, [])
            busy = [h for h in waiting if h.readers]  # a disk write, a get: handed back later
            free = [h for h in waiting if not h.readers]
            if busy:
                self._spares[owner] = busy
        for extra in free[1:]:
            extra.release()
        if not free:
            return []
        free[0].unmap()  # no page of it is read here any more
        return [free[0].fd]

    @contextlib.contextmanager
    def reading(self, kind: str, owner: int, step: int, index: int = 0):
        """The held blob (None if not held), its file kept from its worker while it is read."""
        with self._lock:
            held = self._blobs.get((kind, owner, step, index))
            if held is not None:
                held.readers += 1
        try:
            yield held.blob if held else None
        finally:
            if held is not None:
                self._unpin(held)

    def commit(self, owner: int, step: int) -> None:
        """Step ``step`` is complete everywhere (the worker's own state and every peer's pieces
        arrived): mark what this keeper holds of it, and let older steps go."""
        with self._lock:
            for (kind, o, s, _), held in self._blobs.items():
                if s == step and (kind == "piece" or o == owner):
                    held.meta["committed"], held.meta["pending"] = True, False
            for kind, o in {(k[0], k[1]) for k in self._blobs}:
                self._prune(kind, o)

    def _prune(self, kind: str, owner: int) -> None:
        """Keep the newest ``keep`` committed steps and the newest ``keep`` newer ones: a snapshot
        whose pieces are still travelling never pushes out the last one that is complete. One
        being shipped (``pending``) is kept too: newer snapshots taken while its pieces travel
        (shipments are skipped meanwhile) must not push it out before it is committed."""
        mine = {k: h.meta for k, h in self._blobs.items() if k[0] == kind and k[1] == owner}
        committed = sorted({k[2] for k, meta in mine.items() if meta["committed"]})
        kept = set(committed[-self.keep :])
        newest = committed[-1] if committed else -1
        kept |= set(sorted({k[2] for k in mine if k[2] > newest})[-self.keep :])
        # (Not once a newer one is complete: its shipment was abandoned, the membership changed.)
        kept |= {k[2] for k, meta in mine.items() if meta.get("pending") and k[2] > newest}
        for k in [k for k in mine if k[2] not in kept]:
            self._let_go(k)

    def drop_after(self, step: int) -> None:
        """Forget every state and piece past ``step`` (the run resumes there: they are a future
        that will not happen), once their disk writes are done."""
        self.flush()
        with self._lock:
            for k in [k for k in self._blobs if k[2] > step]:
                self._let_go(k)

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(h.meta, size=len(h.blob)) for h in self._blobs.values()]

    def held_bytes(self) -> int:
        """The bytes held: the items, and the files let go that wait to be handed back."""
        with self._lock:
            spares = [h for waiting in self._spares.values() for h in waiting]
            return sum(len(h.blob) for h in [*self._blobs.values(), *spares])

    def flush(self) -> None:
        self._disk.join()

    def persist(self) -> list[int]:
        """Write every worker state this keeper holds (the newest ``keep`` steps of each) to
        disk, unless there already: what a run that did not finish (its timeout, a stop, Ctrl-C)
        leaves for ``--resume`` after the keeper is gone. All of them, not the newest alone: the
        workers may have handed over different steps when the run stopped, and a resume needs one
        that every worker has (``choose_step``). Peers' pieces (``--redundancy``) stay in memory.
        Returns the steps held, oldest first."""
        if self.directory is None:
            return []
        self.flush()  # a checkpoint on its way lands first
        with self._lock:
            full = sorted(((k, h) for k, h in self._blobs.items() if k[0] == "full"), key=lambda x: x[0])
            for _, held in full:  # read until written, even if let go meanwhile
                held.readers += 1
        try:
            for (_, owner, step, _), held in full:
                if not disk_path(self.directory, owner, step).exists():
                    write_disk_snapshot(self.directory, owner, step, held.blob, held.meta.get("members"))
        finally:
            for _, held in full:
                self._unpin(held)
        for owner in {k[1] for k, _ in full}:
            prune_disk(self.directory, owner, self.keep)
        return [k[2] for k, _ in full]

    def _write_loop(self) -> None:
        while True:
            owner, step, held = self._disk.get()
            try:
                assert self.directory is not None
                write_disk_snapshot(self.directory, owner, step, held.blob, held.meta.get("members"))
                prune_disk(self.directory, owner, self.keep)
            except Exception as e:  # noqa: BLE001 - the writer must outlive any one write (flush waits on it)
                with contextlib.suppress(OSError):  # its log may be on the disk that just filled
                    print(f"geotrain keeper: disk checkpoint failed: {e}", file=sys.stderr, flush=True)
            finally:
                self._unpin(held)
                self._disk.task_done()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        keeper: Keeper = self.server.keeper  # type: ignore[attr-defined]
        keeper.last_request = time.monotonic()
        try:
            header, payload, fds = _recv_with_fds(self.request)
        except (ConnectionError, ValueError, OSError) as e:
            print(f"keeper: a request could not be read: {e!r}", file=sys.stderr, flush=True)
            return
        op = header.get("op")
        if op == "put":
            keeper.put(header, payload)
            _send(self.request, {"ok": True})
        elif op == "put_fd":
            # The trainer's memory file, mapped: this process now holds those pages, no copy made.
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                _send(self.request, {"ok": False, "error": "put_fd needs one file descriptor"})
                return
            try:
                blob = mmap.mmap(fds[0], int(header["length"]), prot=mmap.PROT_READ)
            except (OSError, ValueError, KeyError, TypeError) as e:
                os.close(fds[0])
                _send(self.request, {"ok": False, "error": f"put_fd could not map the file: {e}"})
                return
            try:
                keeper.put(header, blob, fd=fds[0])
            except (KeyError, TypeError, ValueError) as e:
                blob.close()
                os.close(fds[0])
                _send(self.request, {"ok": False, "error": f"put_fd: bad header: {e!r}"})
                return
            spares = keeper.spare_files(int(header["owner"])) if header.get("recycle") else []
            try:
                _send(self.request, {"ok": True, "spares": len(spares)}, fds=spares)
            finally:
                for fd in spares:
                    os.close(fd)
        elif op == "get":
            args = (header["kind"], header["owner"], header["step"], header.get("index", 0))
            with keeper.reading(*args) as blob:
                if blob is None:
                    _send(self.request, {"ok": False, "error": "not held"})
                else:
                    _send(self.request, {"ok": True}, blob)
        elif op == "adopt":  # a new launcher (a resumed run) takes this keeper over
            self.server.parent_pid = int(header["parent_pid"])  # type: ignore[attr-defined]
            _send(self.request, {"ok": True})
        elif op == "drop_after":
            keeper.drop_after(int(header["step"]))
            _send(self.request, {"ok": True})
        elif op == "commit":
            keeper.commit(int(header["owner"]), int(header["step"]))
            _send(self.request, {"ok": True})
        elif op == "list":
            _send(
                self.request,
                {
                    "ok": True,
                    "items": keeper.items(),
                    "held_bytes": keeper.held_bytes(),
                    "parent_pid": self.server.parent_pid,  # type: ignore[attr-defined]
                    "pid": os.getpid(),
                },
            )
        elif op == "flush":
            keeper.flush()
            _send(self.request, {"ok": True})
        elif op == "persist":
            try:
                steps = keeper.persist()
            except OSError as e:  # a full disk: the memory copy stays for a --resume meanwhile
                _send(self.request, {"ok": False, "error": f"writing the snapshot failed: {e}"})
            else:
                _send(self.request, {"ok": True, "steps": steps})
        elif op == "stop":
            keeper.flush()
            _send(self.request, {"ok": True})
            threading.Thread(target=self.server.shutdown, daemon=True).start()
        else:
            _send(self.request, {"ok": False, "error": f"unknown op {op!r}"})
        keeper.last_request = time.monotonic()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve(socket_path: Path, directory: Path | None, linger_s: float, parent_pid: int = 0) -> None:
    """Run a keeper until told to stop, or until its launcher is gone and it idled ``linger_s``."""
    socket_path = Path(socket_path)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    server = _Server(str(socket_path), _Handler)
    server.keeper = Keeper(directory)  # type: ignore[attr-defined]
    server.parent_pid = parent_pid  # type: ignore[attr-defined]

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            parent = server.parent_pid  # type: ignore[attr-defined]
            orphan = parent > 0 and not _alive(parent)
            idle = time.monotonic() - server.keeper.last_request  # type: ignore[attr-defined]
            if (orphan or parent <= 0) and linger_s > 0 and idle > linger_s:
                server.shutdown()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(
            signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start()
        )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.keeper.flush()  # type: ignore[attr-defined]
        server.server_close()
        with contextlib.suppress(OSError):
            socket_path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- client ----------------------------------------------------------------------------------
class KeeperClient:
    """Talks to one keeper; each call is one short connection."""

    def __init__(self, socket_path: str | Path, timeout_s: float = 120.0) -> None:
        self.path = str(socket_path)
        self.timeout_s = timeout_s

    def _call(
        self, header: dict[str, Any], payload: bytes | memoryview = b"", fds: list[int] | None = None
    ) -> tuple[dict, bytes]:
        reply, data, given = self._call_with_fds(header, payload, fds)
        for fd in given:  # none asked for
            os.close(fd)
        return reply, data

    def _call_with_fds(
        self, header: dict[str, Any], payload: bytes | memoryview = b"", fds: list[int] | None = None
    ) -> tuple[dict, bytes, list[int]]:
        given: list[int] = []
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout_s)
                s.connect(self.path)
                _send(s, header, payload, fds)
                reply, data, given = _recv_with_fds(s)
        except (OSError, ConnectionError, ValueError) as e:
            for fd in given:
                os.close(fd)
            raise KeeperError(f"keeper at {self.path}: {e}") from None
        if not reply.get("ok"):
            for fd in given:
                os.close(fd)
            raise KeeperError(f"keeper at {self.path}: {reply.get('error')}")
        return reply, data, given

    def alive(self) -> bool:
        try:
            self._call({"op": "list"})
        except KeeperError:
            return False
        return True

    def put(
        self,
        kind: str,
        owner: int,
        step: int,
        blob: bytes,
        index: int = 0,
        disk: bool = False,
        commit: bool = False,
        **meta: Any,
    ) -> None:
        header = {"op": "put", "kind": kind, "owner": owner, "step": step, "index": index}
        self._call({**header, "disk": disk, "commit": commit, **meta}, blob)

    def put_fd(
        self,
        kind: str,
        owner: int,
        step: int,
        fd: int,
        length: int,
        disk: bool = False,
        commit: bool = False,
        pending: bool = False,
        members: list[int] | None = None,
        recycle: bool = False,
    ) -> list[int]:
        """Hand over a sealed memory file (``ft.state.encode_to_memfd``): the keeper maps it.
        ``pending``: it is about to be shipped to the peers and committed. ``members``: the hosts
        training together at this step, after a membership change (None: every host).
        ``recycle``: return the memory file of an earlier snapshot the keeper let go, if any (the
        caller's to write into and close): the list of descriptors, empty or one."""
        header = {"op": "put_fd", "kind": kind, "owner": owner, "step": step, "index": 0, "length": length}
        header |= {"disk": disk, "commit": commit, "pending": pending, "recycle": recycle}
        if members is not None:
            header["members"] = list(members)
        return self._call_with_fds(header, fds=[fd])[2]

    def commit(self, owner: int, step: int) -> None:
        self._call({"op": "commit", "owner": owner, "step": step})

    def drop_after(self, step: int) -> None:
        self._call({"op": "drop_after", "step": step})

    def adopt(self, parent_pid: int) -> None:
        """Make ``parent_pid`` the launcher whose death starts this keeper's linger."""
        self._call({"op": "adopt", "parent_pid": parent_pid})

    def get(self, kind: str, owner: int, step: int, index: int = 0) -> bytes:
        return self._call({"op": "get", "kind": kind, "owner": owner, "step": step, "index": index})[1]

    def items(self) -> list[dict[str, Any]]:
        return self._call({"op": "list"})[0]["items"]

    def held_bytes(self) -> int:
        return int(self._call({"op": "list"})[0]["held_bytes"])

    def parent_pid(self) -> int:
        """The launcher this keeper belongs to (0: none)."""
        return int(self._call({"op": "list"})[0]["parent_pid"])

    def pid(self) -> int:
        """The keeper's process id (chaos kills it to emulate a lost host)."""
        return int(self._call({"op": "list"})[0]["pid"])

    def flush(self) -> None:
        self._call({"op": "flush"})

    def persist(self) -> list[int]:
        """Every worker state held, written to disk (``Keeper.persist``); the steps held."""
        return [int(s) for s in self._call({"op": "persist"})[0]["steps"]]

    def stop(self) -> None:
        """Stop the keeper, and return once it no longer answers: it replies before it shuts
        down, and a client that connected in between would still be served (a flaky test once
        read the stopped keeper's snapshot instead of the disk's)."""
        self._call({"op": "stop"})
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.02)


def wait_ready(path: Path, timeout_s: float = 20.0) -> None:
    client = KeeperClient(path, timeout_s=2.0)
    deadline = time.monotonic() + timeout_s
    while not client.alive():
        if time.monotonic() > deadline:
            raise KeeperError(f"no keeper answered at {path} within {timeout_s:.0f} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="geotrain keeper",
        description="Hold this host's training snapshots in memory, outliving the trainer.",
    )
    p.add_argument("--socket", required=True, help="the Unix socket path; give the trainer --keeper PATH")
    p.add_argument("--dir", default="", help="where disk checkpoints go (empty: none)")
    p.add_argument("--linger", type=float, default=600.0, help="idle seconds before exiting once orphaned")
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    serve(Path(args.socket), Path(args.dir) if args.dir else None, args.linger, args.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
