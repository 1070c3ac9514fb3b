"""A keeper hands the memory file of a snapshot it let go back to its worker, never one it reads."""

from __future__ import annotations

import mmap
import os
import threading

import pytest

from geotrain.ft import keeper as keeper_module
from geotrain.ft.keeper import Keeper, KeeperClient, disk_path
from geotrain.ft.snapshots import SnapshotConfig, Snapshotter
from geotrain.ft.state import CorruptSnapshot, decode, decode_memfd, encode_to_memfd, seal_memfd


def _put(client: KeeperClient, step: int, fd: int | None = None, **kw) -> tuple[int, list[int]]:
    fd, size = encode_to_memfd({"step": step, "pad": b"x" * 5000}, "test", fd)
    seal_memfd(fd, size)
    try:
        return fd, client.put_fd("full", 0, step, fd, size, commit=True, recycle=True, **kw)
    finally:
        os.close(fd)


def test_the_file_of_a_snapshot_let_go_comes_back_and_the_held_ones_stay_intact(keeper):
    client, _ = keeper
    for step in (1, 2):
        assert _put(client, step)[1] == []  # the keeper holds both: nothing to hand back
    _, back = _put(client, 3)  # step 1 let go (it keeps two): its file comes back
    assert len(back) == 1
    assert decode_memfd(back[0], os.fstat(back[0]).st_size)["step"] == 1  # step 1's pages
    # Written into by the worker (from offset 0, whatever its last writer left), it holds step 4,
    # and the steps the keeper still holds are what they were.
    _, again = _put(client, 4, fd=back[0])
    assert len(again) == 1
    os.close(again[0])
    assert sorted(i["step"] for i in client.items()) == [3, 4]
    assert decode(client.get("full", 0, 3))["step"] == 3
    assert decode(client.get("full", 0, 4))["step"] == 4
    # A put that does not ask for recycling gets no descriptor.
    fd, size = encode_to_memfd({"step": 5}, "test")
    try:
        assert client.put_fd("full", 0, 5, fd, size, commit=True) == []
    finally:
        os.close(fd)


def _held(store: Keeper, step: int, disk: bool = False) -> int:
    fd, size = encode_to_memfd({"step": step}, "test")
    seal_memfd(fd, size)
    header = {"kind": "full", "owner": 0, "step": step, "commit": True, "disk": disk, "recycle": True}
    store.put(header, mmap.mmap(fd, size, prot=mmap.PROT_READ), fd=fd)
    return fd


def test_a_file_being_read_or_written_to_disk_is_not_handed_back_until_that_is_done(tmp_path, monkeypatch):
    store = Keeper(tmp_path)
    first = _held(store, 1)
    with store.reading("full", 0, 1) as blob:  # a get of step 1 under way
        _held(store, 2), _held(store, 3)  # step 1 let go (two are kept)
        assert store.spare_files(0) == []
        assert decode(blob)["step"] == 1
    assert store.spare_files(0) == [first]
    os.close(first)
    # A disk write of a step let go before it is written holds its file too.
    gate = threading.Event()
    real_write = keeper_module.write_disk_snapshot
    monkeypatch.setattr(keeper_module, "write_disk_snapshot", lambda *a: (gate.wait(10), real_write(*a)))
    fourth = _held(store, 4, disk=True)
    _held(store, 5), _held(store, 6)  # 2, 3 and 4 let go
    back = store.spare_files(0)
    # One free file is kept to hand back (3's; 2's was closed), and 4's waits for its write.
    assert len(back) == 1 and fourth not in back
    for fd in back:
        os.close(fd)
    gate.set()
    store.flush()
    assert decode(disk_path(tmp_path, 0, 4).read_bytes())["step"] == 4
    assert store.spare_files(0) == [fourth]
    os.close(fourth)


def test_snapshots_from_the_fourth_on_are_written_into_recycled_pages(keeper):
    client, _ = keeper
    snap = Snapshotter(SnapshotConfig(every=1, keeper=str(client.path)), 0, 1, size_hint=1 << 16)
    states = {}
    for step in range(1, 7):
        states[step] = {"step": step, "parts": {"x": list(range(step * 100))}, "shared": []}
        snap.take(step, lambda copy, s=step: states[s])
    snap.close()
    assert not snap.stats.errors
    # Put 3 lets 1 go, its file comes back and takes snapshot 4; so do 2's, 3's (5, 6).
    assert snap.stats.recycled == 3
    for step in (5, 6):
        assert decode(client.get("full", 0, step))["parts"] == states[step]["parts"]


def test_a_corrupt_memory_file_is_reported_as_such():
    fd, size = encode_to_memfd({"step": 1}, "test")  # never sealed: no valid header
    try:
        with pytest.raises(CorruptSnapshot, match="not a geotrain snapshot"):
            decode_memfd(fd, size)
    finally:
        os.close(fd)


def test_a_worker_that_does_not_take_files_back_leaves_none_held(tmp_path):
    store = Keeper(tmp_path)
    for step in (1, 2, 3, 4):
        fd, size = encode_to_memfd({"step": step}, "test")
        seal_memfd(fd, size)
        store.put({"kind": "full", "owner": 0, "step": step, "commit": True}, mmap.mmap(fd, size), fd=fd)
    files = [h.fd for h in store._blobs.values() if h.fd is not None]
    assert store._spares == {} and len(files) == 2  # the two let go were closed at once


def test_a_file_the_shipping_thread_reads_is_not_written_into(keeper):
    client, _ = keeper
    snap = Snapshotter(SnapshotConfig(every=1, keeper=str(client.path)), 0, 1)
    try:
        read, free = (encode_to_memfd({"step": s}, "test")[0] for s in (1, 2))
        snap._shipping_files.add(os.fstat(read).st_ino)  # as _store marks one it queues for shipping
        chosen = snap._next_file([read, free], 1 << 16)
        assert chosen == free and snap._next_recycled
        with pytest.raises(OSError):
            os.fstat(read)  # closed: the shipping thread reads its own descriptor of that file
        os.close(chosen)
        fresh = snap._next_file([], 1 << 16)
        assert os.fstat(fresh).st_size == 1 << 16 and not snap._next_recycled
        os.close(fresh)
    finally:
        snap.close()
