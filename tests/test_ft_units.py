"""Snapshots, keepers and redundancy without a process group: framing, zfec, choosing a step."""

from __future__ import annotations

import itertools
import os
import threading

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.compress.codec import ConfigError
from geotrain.ft.atomic import write_atomic
from geotrain.ft.keeper import KeeperClient, disk_members, disk_path
from geotrain.ft.redundancy import parse_redundancy
from geotrain.ft.snapshots import (
    ResumeError,
    SnapshotConfig,
    Snapshotter,
    admitted_state,
    availability,
    choose_step,
    members_at,
    preflight,
)
from geotrain.ft.state import (
    CorruptSnapshot,
    capture,
    decode,
    encode,
    join,
    param_digest,
    restore,
    split,
    verify,
)
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import build_sync


def _blob(n: int = 10_000, seed: int = 0) -> bytes:
    return bytes(
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).tolist()
    )


def test_encode_roundtrip_and_detects_truncation_and_corruption():
    obj = {"a": torch.arange(10.0), "b": [1, "x"], "c": {"d": torch.ones(3, 3)}}
    blob = encode(obj)
    back = decode(blob)
    assert torch.equal(back["a"], obj["a"]) and back["b"] == [1, "x"]
    assert verify(blob)
    with pytest.raises(CorruptSnapshot, match="truncated"):
        decode(blob[:-1])
    with pytest.raises(CorruptSnapshot, match="truncated"):
        decode(blob[:10])
    bad = bytearray(blob)
    bad[-5] ^= 0xFF
    assert not verify(bytes(bad))
    with pytest.raises(CorruptSnapshot, match="checksum"):
        decode(bytes(bad))


def test_a_snapshots_memory_file_is_framed_with_a_crc_that_catches_a_flipped_bit():
    """Snapshots are sealed with a CRC32 (GEOSNAP2: a sha256 cost 1.7 s of ``mini``'s 131 MB per
    period); hand-over frames keep a sha256 (GEOSNAP1); both decode, and both catch damage."""
    import mmap
    import os

    from geotrain.ft.state import MAGIC, MAGIC_CRC, decode_memfd, encode_to_memfd, seal_memfd

    obj = {"a": torch.arange(1000.0), "b": [1, "x"]}
    fd, size = encode_to_memfd(obj, "test")
    try:
        seal_memfd(fd, size)
        back = decode_memfd(fd, size)
        assert torch.equal(back["a"], obj["a"]) and back["b"] == [1, "x"]
        with mmap.mmap(fd, size) as mm:
            blob = bytes(mm)
        assert blob[:8] == MAGIC_CRC and verify(blob)
        for where in (60, size // 2, size - 1):  # the payload, anywhere
            for bit in (0x01, 0x80):
                bad = bytearray(blob)
                bad[where] ^= bit
                assert not verify(bytes(bad))
                with pytest.raises(CorruptSnapshot, match="checksum"):
                    decode(bytes(bad))
    finally:
        os.close(fd)
    assert bytes(encode(obj)[:8]) == MAGIC  # the hand-over's frames: equal headers, equal bytes


def test_snapshots_skip_torchs_per_record_crc_and_leave_the_setting_as_it_was():
    """torch.save's CRC32 of every record cost as much as the copy (0.09-0.11 s of 0.05 s for
    138 MB): the frames carry their own checksum, so snapshots are written without it, and the
    user's setting (torch keeps one per thread) is back after each one, in every thread."""
    import threading

    seen = []
    real_save = torch.save

    def spy(*args, **kwargs):
        seen.append(torch.serialization.get_crc32_options())
        return real_save(*args, **kwargs)

    obj = {"a": torch.arange(1000.0)}
    try:
        torch.save = spy
        threads = [threading.Thread(target=lambda: decode(encode(obj))) for _ in range(4)]
        for t in threads:
            t.start()
        back = decode(encode(obj))
        for t in threads:
            t.join()
    finally:
        torch.save = real_save
    assert torch.equal(back["a"], obj["a"]) and seen and not any(seen)
    assert torch.serialization.get_crc32_options() is True
    torch.serialization.set_crc32_options(False)  # a user's own choice is kept too
    try:
        encode(obj)
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)


def test_equal_states_encode_to_equal_bytes_after_one_was_loaded_from_the_other():
    """A joiner loads the members' DiLoCo state; after the same outer steps its state must
    encode to the members' bytes (pickle's memo once made them differ: stripes from 1 member)."""

    def worker():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.AdamW(model.parameters())
        return model, optimizer, build_sync("diloco", model, optimizer, Communicator(), {"H": 2})

    def steps(model, optimizer, sync, n):
        for _ in range(n):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            sync.after_step()

    member, joiner = worker(), worker()
    steps(*member, 4)
    for mine, theirs in zip(joiner, member, strict=True):
        mine.load_state_dict(decode(encode(theirs.state_dict())))
    steps(*member, 2)
    steps(*joiner, 2)
    for mine, theirs in zip(joiner, member, strict=True):
        assert bytes(encode(mine.state_dict())) == bytes(encode(theirs.state_dict()))
    model = member[0].state_dict()
    assert decode(encode(model))._metadata == model._metadata  # what a module's loader reads


@pytest.mark.parametrize("spec", ["ec:2/3", "ec:3/5", "ec:1/2", "ec:4/4"])
def test_zfec_rebuilds_from_every_k_subset(spec):
    scheme = parse_redundancy(spec)
    for size in (1, 4097, 10_003):
        data = _blob(size, seed=size)
        pieces = scheme.pieces(data, owner=1, step=7)
        assert len(pieces) == scheme.n
        for subset in itertools.combinations(range(scheme.n), scheme.k):
            assert scheme.rebuild([pieces[i] for i in subset]) == data
        if scheme.k < scheme.n:
            # A corrupted piece is detected and skipped; the others still rebuild.
            bad = bytearray(pieces[0])
            bad[-1] ^= 1
            assert scheme.rebuild([bytes(bad)] + pieces[1:]) == data
        with pytest.raises(CorruptSnapshot, match="needed"):
            scheme.rebuild(pieces[: scheme.k - 1])


def test_ring_piece_is_the_whole_blob_and_corruption_is_refused():
    scheme = parse_redundancy("ring")
    data = _blob()
    (piece,) = scheme.pieces(data, 0, 1)
    assert scheme.rebuild([piece]) == data
    bad = bytearray(piece)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(CorruptSnapshot):
        scheme.rebuild([bytes(bad)])


@pytest.mark.parametrize("spec", ["ec:3/2", "ec:0/1", "ec:2", "raid5", "ec:a/b"])
def test_bad_redundancy_specs_say_what_is_accepted(spec):
    with pytest.raises(ConfigError, match="ec:"):
        parse_redundancy(spec)


def test_redundancy_needs_enough_peers():
    with pytest.raises(ConfigError, match="only 2"):
        parse_redundancy("ec:2/3", world_size=3)
    assert parse_redundancy("ec:2/3", world_size=4).holders(3, 4) == [0, 1, 2]


def _model_and_sync(algo="diloco"):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = build_sync(algo, model, opt, Communicator(), {"H": 2})
    return model, opt, sync


def _train_steps(model, opt, sync, n, gen):
    for _ in range(n):
        xy = torch.randint(0, 256, (2, 17), generator=gen)
        _, loss = sync.model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        sync.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync.after_step()


def test_capture_restore_is_exact_and_split_join_rebuilds_the_state():
    model, opt, sync = _model_and_sync()
    gen = torch.Generator().manual_seed(1)
    _train_steps(model, opt, sync, 3, gen)
    state = capture(
        step=3,
        model=model,
        optimizer=opt,
        sync=sync,
        generators={"sampler": gen},
        progress={"train_s": 1.0},
        replicated=sync.replicated_parts(),
    )
    # The copy is deep: training on does not change it.
    _train_steps(model, opt, sync, 2, gen)
    expected_after = param_digest(model)

    model2, opt2, sync2 = _model_and_sync()
    gen2 = torch.Generator()
    progress = restore(
        decode(encode(state)), model=model2, optimizer=opt2, sync=sync2, generators={"sampler": gen2}
    )
    assert progress["step"] == 3 and sync2.step_count == 3
    _train_steps(model2, opt2, sync2, 2, gen2)
    assert param_digest(model2) == expected_after

    shared, unique = split(state)
    assert "model" not in unique["parts"] or "model" not in state["shared"]
    rebuilt = join(decode(encode(unique)), decode(encode(shared)))
    assert encode(rebuilt["parts"]["optimizer"]) == encode(state["parts"]["optimizer"])
    # A peer whose "shared" part differs is refused.
    shared["sync"]["outer_params"][0] += 1
    with pytest.raises(CorruptSnapshot, match="differs"):
        join(unique, shared)


def _avail(keeper=(), disk=(), pieces=()):
    return {"keeper": list(keeper), "disk": list(disk), "pieces": [list(p) for p in pieces]}


def test_choose_step_prefers_the_newest_step_everyone_can_reach():
    avail = [_avail(keeper=[4, 8]), _avail(keeper=[4], disk=[8])]
    assert choose_step(avail) == (8, {0: "keeper", 1: "disk"})
    # Rank 1 lost everything; rank 0 holds its ring copy at 4 only.
    avail = [_avail(keeper=[4, 8], pieces=[(1, 4, 0, 1, 1)]), _avail()]
    assert choose_step(avail) == (4, {0: "keeper", 1: "peers"})
    # ec:2/3 needs two distinct pieces.
    avail = [
        _avail(),
        _avail(keeper=[5], pieces=[(0, 5, 1, 2, 3)]),
        _avail(keeper=[5], pieces=[(0, 5, 2, 2, 3)]),
    ]
    assert choose_step(avail)[1][0] == "peers"
    avail[2]["pieces"] = []
    with pytest.raises(ResumeError, match="rank 0: nothing"):
        choose_step(avail)
    with pytest.raises(ResumeError, match="step 3"):
        choose_step([_avail(keeper=[4])], requested=3)


def test_after_a_membership_change_hosts_that_were_not_training_come_back_from_a_member():
    """Snapshots taken after a membership change name the hosts training then: the newest such
    step wins, and a host outside it (lost, not replaced) is rebuilt from a member's state."""
    members = {20: [0, 1]}
    avail = [
        _avail(keeper=[10, 20]) | {"members": dict(members)},
        _avail(disk=[10, 20]) | {"members": dict(members)},
        _avail(keeper=[10]),  # host 2's keeper still holds its state from before it was lost
    ]
    assert members_at(avail, 20) == [0, 1] and members_at(avail, 10) == [0, 1, 2]
    assert choose_step(avail) == (20, {0: "keeper", 1: "disk", 2: "member"})
    # Holders that disagree (one took step 20 in the old epoch) fall back to a step all agree on.
    avail[0]["members"][20] = [0, 1, 2]
    assert choose_step(avail) == (10, {0: "keeper", 1: "disk", 2: "keeper"})
    # A holder that recorded no members took it in the first epoch: every host must have it.
    del avail[0]["members"][20]
    assert choose_step(avail)[0] == 10
    # Nobody who was training holds a full state: nothing to rebuild from.
    with pytest.raises(ResumeError, match="no way to restore"):
        choose_step([_avail(pieces=[(1, 20, 0, 1, 1)]) | {"members": {}}, _avail()], requested=20)


def test_admitted_state_hands_over_what_a_joiner_gets():
    state = {
        "step": 8,
        "parts": {
            p: {"x": i} for i, p in enumerate(("model", "optimizer", "sync", "codec", "rng", "progress"))
        },
        "shared": ["model", "sync"],
    }
    got = admitted_state(state)
    assert got["admitted"] and got["step"] == 8 and sorted(got["parts"]) == ["model", "progress", "sync"]
    state["shared"].append("optimizer")  # S-SGD, DDP: every worker's optimizer is the same
    assert "optimizer" in admitted_state(state)["parts"]
    state["parts"]["codec_shared"] = {"x": 9}  # (a snapshot from before it was saved has none: above)
    assert admitted_state(state)["parts"]["codec_shared"] == {"x": 9}


def test_two_hosts_killed_at_one_step_are_two_faults_each_with_its_replacement(tmp_path):
    """The launcher takes the fired fault aimed at the host that failed, and leaves the other
    for its own host's failure (it took both at the first, and recorded the second host's as an
    exit with no replacement)."""
    from geotrain.ft.chaos import fired_marker, parse_chaos
    from geotrain.launch.local import _take_fired

    faults = parse_chaos("kill:step=150,rank=1,restart=1;kill:step=150,rank=2,restart=3")
    for f in faults:
        fired_marker(tmp_path, f).touch()
    second = _take_fired(faults, tmp_path, failed=2)
    assert [(f.rank, f.restart_s) for f in second] == [(2, 3.0)]
    first = _take_fired(faults, tmp_path, failed=1)
    assert [(f.rank, f.restart_s) for f in first] == [(1, 1.0)] and faults == []
    faults = parse_chaos("kill:step=150,rank=1;kill:step=150,rank=2")
    for f in faults:
        fired_marker(tmp_path, f).touch()
    assert len(_take_fired(faults, tmp_path)) == 2 and faults == []  # (a restore takes them all)


def test_a_codecs_shared_entries_are_a_part_of_their_own_handed_over_and_never_compared():
    """ACP-SGD's turn and factors go in "codec_shared", which a joiner gets and a snapshot keeps
    with the worker's own parts: a survivor that counted a redone message twice holds another
    count, and a rebuild from its peer must not refuse that (the "sync" part it compares)."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = build_sync("ssgd", model, opt, Communicator(), {"compress": "acpsgd:rank=2"})
    _train_steps(model, opt, sync, 3, torch.Generator().manual_seed(1))
    # (alone, no mean is taken: a stream as three messages among workers leave it)
    entries = {
        "step": torch.tensor(3),
        "p0": torch.ones(8, 2),
        "q0": torch.ones(8, 2),
        "e0": torch.ones(8, 8),
    }
    sync.codec.state(("grad", 0)).update(entries)
    state = capture(
        step=3, model=model, optimizer=opt, sync=sync, generators={}, progress={},
        replicated=sync.replicated_parts(),
    )  # fmt: skip
    parts = state["parts"]
    assert "codec_shared" not in parts["sync"] and "codec_shared" not in state["shared"]
    names = {name for _, entries in parts["codec_shared"]["streams"] for name in entries}
    assert names == {"step", "p0", "q0"}
    assert any(n.startswith("e") for _, v in parts["codec"]["streams"] for n in v)  # the residuals: own
    # a joiner's fresh codec takes the shared entries, and no residual
    joiner = build_sync("ssgd", model, opt, Communicator(), {"compress": "acpsgd:rank=2"})
    restore(admitted_state(state), model=model, optimizer=opt, sync=joiner, generators={})
    streams = joiner.codec.state_dict()["streams"]
    assert {n for _, v in streams for n in v} == names
    shared, unique = split(state)
    peer = {p: v for p, v in shared.items()}
    unique["parts"]["codec_shared"]["streams"][0][1]["step"] += 1  # counted twice on this worker
    rebuilt = join(decode(encode(unique)), decode(encode(peer)))
    assert int(rebuilt["parts"]["codec_shared"]["streams"][0][1]["step"]) == 4


def test_keeper_holds_the_newest_two_steps_and_writes_disk_from_its_copy(keeper):
    client, snaps = keeper
    for step in (1, 2, 3):
        client.put("full", 0, step, encode({"step": step}), disk=step == 3, commit=True)
    client.put("piece", 1, 3, b"xyz", index=0, k=1, n=1)
    assert sorted(i["step"] for i in client.items() if i["kind"] == "full") == [2, 3]
    assert decode(client.get("full", 0, 3)) == {"step": 3}
    assert client.get("piece", 1, 3) == b"xyz"
    client.flush()
    assert decode(disk_path(snaps, 0, 3).read_bytes()) == {"step": 3}
    assert not disk_path(snaps, 0, 2).exists()  # only what was asked goes to disk


def test_keeper_persists_every_worker_state_it_holds_once(keeper):
    """A run that did not finish: every worker state held goes to disk with its members (a newer
    step not yet complete everywhere too: another worker may have only the older one, and a
    resume needs one they all have), each once; peers' pieces stay in memory."""
    client, snaps = keeper
    client.put("full", 0, 4, encode({"step": 4}), commit=True, members=[0, 2])
    client.put("full", 0, 8, encode({"step": 8}))  # not complete everywhere yet
    client.put("full", 3, 8, encode({"owner": 3}), commit=True)
    client.put("piece", 1, 8, b"xyz", index=0, k=1, n=1)
    assert client.persist() == [4, 8, 8]
    assert decode(disk_path(snaps, 0, 4).read_bytes()) == {"step": 4}
    assert disk_members(snaps, 0, 4) == [0, 2]
    assert decode(disk_path(snaps, 0, 8).read_bytes()) == {"step": 8}
    assert decode(disk_path(snaps, 3, 8).read_bytes()) == {"owner": 3}
    assert not (snaps / "rank1").exists()
    written = disk_path(snaps, 0, 8).stat().st_mtime_ns
    client.put("full", 0, 12, encode({"step": 12}), commit=True)  # the keeper now holds 4 and 12
    assert client.persist() == [4, 12, 8]
    assert decode(disk_path(snaps, 0, 12).read_bytes()) == {"step": 12}
    assert disk_path(snaps, 0, 8).stat().st_mtime_ns == written  # not written again
    assert not disk_path(snaps, 0, 4).exists()  # the disk keeps the newest two, as a checkpoint's


def test_snapshotter_stores_in_the_background_and_preflight_names_the_previous_good(keeper, tmp_path):
    client, snaps = keeper
    snap = Snapshotter(SnapshotConfig(every=2, keeper=str(client.path), directory=snaps), 0, 1)
    for step in (2, 4):
        snap.take(
            step,
            lambda copy, step=step: {"step": step, "parts": {}, "shared": [], "shared_digest": {}},
            final=True,
        )
    snap.close()
    assert snap.stats.taken == 2 and not snap.stats.errors
    assert preflight([client], snaps)[0] == 4
    # Keeper gone, the disk copy of step 4 corrupted: refused, naming step 2.
    client.stop()
    path = disk_path(snaps, 0, 4)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    write_atomic(path, bytes(data))
    with pytest.raises(
        ResumeError, match=r"step 4 .* fails its checksum; the previous good snapshot is step 2"
    ):
        preflight([KeeperClient(client.path, timeout_s=1)], snaps)
    assert preflight([KeeperClient(client.path, timeout_s=1)], snaps, requested=2)[0] == 2
    assert os.path.exists(disk_path(snaps, 0, 2))


def test_snapshots_after_a_membership_change_record_their_members_in_keeper_and_on_disk(keeper, tmp_path):
    client, snaps = keeper
    snap = Snapshotter(SnapshotConfig(every=2, keeper=str(client.path), directory=snaps), 1, 1)
    state = lambda copy, step: {"step": step, "parts": {}, "shared": [], "shared_digest": {}}  # noqa: E731
    snap.take(2, lambda copy: state(copy, 2), final=True)
    snap.take(4, lambda copy: state(copy, 4), final=True, members=[0, 1])
    snap.take(6, lambda copy: state(copy, 6), final=True, members=[1, 2])
    snap.close()
    client.flush()
    got = availability(1, client, snaps)
    assert got["keeper"] == [4, 6] and got["disk"] == [4, 6]
    assert got["members"] == {4: [0, 1], 6: [1, 2]}
    # Disk alone says the same; the members of a pruned snapshot go with it.
    assert availability(1, None, snaps)["members"] == {4: [0, 1], 6: [1, 2]}
    assert sorted(p.name for p in (snaps / "rank1").iterdir()) == [
        "step00000004.members", "step00000004.snap", "step00000006.members", "step00000006.snap",
    ]  # fmt: skip


def test_a_descriptor_message_survives_a_keeper_that_answers_and_closes_at_once(monkeypatch):
    """The keeper maps the file, answers and closes while the sender may still be in ``_send``:
    an empty trailing send to that closed peer used to fail one snapshot in five (EPIPE)."""
    import socket

    from geotrain.ft import keeper as keeper_mod

    a, b = socket.socketpair()
    real = socket.send_fds

    def send_then_peer_closes(sock, buffers, fds):
        n = real(sock, buffers, fds)
        _, _, got = keeper_mod._recv_with_fds(b)
        for fd in got:
            os.close(fd)
        b.close()
        return n

    monkeypatch.setattr(socket, "send_fds", send_then_peer_closes)
    r, w = os.pipe()
    try:
        keeper_mod._send(a, {"op": "put_fd", "length": 0}, fds=[r])
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()


def test_a_snapshot_being_shipped_is_not_pushed_out_by_newer_ones():
    """Shipments are skipped while one travels, so several newer snapshots can arrive before it
    is committed: the one in flight must survive them, or no step is common after a lost host
    (seen on 100 Mbit/s links: own fulls of steps 6 and 8, the peers' pieces of step 2 only)."""
    from geotrain.ft.keeper import Keeper

    store = Keeper(None, keep=2)
    store.put({"kind": "full", "owner": 0, "step": 2, "pending": True}, b"2")
    for step in (4, 6, 8):
        store.put({"kind": "full", "owner": 0, "step": step}, str(step).encode())
    assert sorted(i["step"] for i in store.items()) == [2, 6, 8]
    store.commit(0, 2)
    assert sorted((i["step"], i["committed"]) for i in store.items()) == [(2, True), (6, False), (8, False)]
    # The membership changed mid-shipment (redundancy dropped): once newer steps are complete
    # locally, the abandoned one goes.
    store = Keeper(None, keep=2)
    store.put({"kind": "full", "owner": 0, "step": 2, "pending": True}, b"2")
    for step in (4, 6, 8):
        store.put({"kind": "full", "owner": 0, "step": step, "commit": True}, str(step).encode())
    assert sorted(i["step"] for i in store.items()) == [6, 8]


def test_a_resume_at_a_step_drops_the_newer_snapshots_of_its_worker(keeper, tmp_path):
    """They belong to a future that will not happen, and would outrank the run's new snapshots
    (a keeper keeps the newest steps; a later resume takes the newest)."""
    from geotrain.ft.snapshots import drop_after

    client, snaps = keeper
    snap = Snapshotter(SnapshotConfig(every=2, keeper=str(client.path), directory=snaps), 0, 1)
    for step in (4, 6):
        snap.take(step, lambda copy, s=step: {"step": s, "parts": {}, "shared": []}, final=True, members=[0])
    snap.close()
    client.flush()
    client.put("piece", 1, 6, b"x", index=0, k=1, n=1)  # held for another worker: void as well
    client.put("piece", 1, 4, b"y", index=0, k=1, n=1)
    drop_after(0, 4, client, snaps)
    assert sorted((i["kind"], i["step"]) for i in client.items()) == [("full", 4), ("piece", 4)]
    assert sorted(p.name for p in (snaps / "rank0").iterdir()) == [
        "step00000004.members",
        "step00000004.snap",
    ]


class _Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    def read1(self, n: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.parametrize(
    "chunks, shown",
    [
        # torchrun's report of a dead trainer, split across two reads: none of it shows
        ([b"a\nE1 api.py:836] failed (exitcode: -9) local_rank: 0", b" (pid: 7)\nb\n"], b"a\nb\n"),
        ([b"x\nE1 api.py:836] failed (exit", b"code: -9) y\nz"], b"x\nz"),
        ([b"abc", b"def\n"], b"abcdef\n"),
        ([b"\rbar 1", b"\rbar 2", b"\n"], b"\rbar 1\rbar 2\n"),  # a progress bar's updates
    ],
)
def test_the_launcher_echoes_a_hosts_output_without_its_quiet_lines_even_split(monkeypatch, chunks, shown):
    import io
    import sys

    from geotrain.launch import procs

    terminal, log = io.BytesIO(), io.BytesIO()
    monkeypatch.setattr(sys, "stderr", type("Err", (), {"buffer": terminal}))
    procs.pump(_Chunks(chunks), log, echo=True)
    assert terminal.getvalue() == shown
    assert log.getvalue() == b"".join(chunks)  # the host's log keeps everything


@pytest.mark.parametrize("quiet", [False, True])
def test_a_host_agent_stopped_while_it_exits_ends_without_a_traceback(quiet):
    """torchrun's SIGTERM handler stays installed after its ``main()``: a host agent the launcher
    stopped while it was exiting printed a SignalException traceback from a weakref finaliser
    (CI, stop 51). ``quiet=False`` reproduces that; the agent's own exit then ends with 143."""
    import subprocess
    import sys

    child = f"""
import atexit, os, signal, sys, time
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
signal.signal(signal.SIGTERM, _terminate_process_handler)  # as torchrun's PContext.start does
from geotrain.launch.agent import exit_quietly_on_signals
if {quiet}:
    exit_quietly_on_signals()
def stopped_while_exiting():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)
atexit.register(stopped_while_exiting)
sys.exit(1)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    if quiet:
        assert proc.returncode == 128 + 15 and "Traceback" not in proc.stderr, proc.stderr
    else:
        assert "SignalException" in proc.stderr  # what the fix removes is real


@pytest.mark.parametrize("quiet", [False, True])
def test_a_failed_exit_barrier_after_the_trainers_finished_is_one_log_line_not_a_traceback(quiet):
    """torchrun's agents meet at an exit barrier in the store host 0's agent serves; host 0 may
    pass it and exit before another agent's wait reads the answer, and that agent logged a
    traceback though the run had ended well (CI, the stop after 51). torch's own ``_exit_barrier`` runs
    here against a store whose server is gone; ``quiet=False`` shows the traceback is real."""
    import subprocess
    import sys

    child = f"""
import types
from torch.distributed import DistNetworkError
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from geotrain.launch.agent import keep_exit_barrier_errors_to_the_log

class ServerGone:  # a client of a TCPStore whose serving agent has exited
    timeout = None
    def set_timeout(self, timeout): self.timeout = timeout
    def add(self, key, n): return 1
    def wait(self, keys): raise DistNetworkError("Failed to recv, got 0 bytes.")

if {quiet}:
    keep_exit_barrier_errors_to_the_log()
agent = types.SimpleNamespace(
    _store=ServerGone(), _worker_group=types.SimpleNamespace(group_world_size=2, state="SUCCEEDED"),
    _exit_barrier_timeout=5, _in_exit_barrier=False,
)
SimpleElasticAgent._exit_barrier(agent)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if quiet:
        assert "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith("geotrain agent: the exit barrier failed") and "Failed to recv" in line
    else:
        assert "Traceback" in proc.stderr and "Error waiting on exit barrier" in proc.stderr


def test_the_keepers_disk_writer_outlives_a_full_disk_and_a_log_it_cannot_write(tmp_path, monkeypatch):
    """A disk that fills fails the write and then the line saying so (the keeper's log is on
    it too): the writer goes on, so ``flush`` (and a stopped run's ``persist``) returns."""
    import sys

    import geotrain.ft.keeper as keeper_module

    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            raise OSError(28, "No space left on device")

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    keeper = keeper_module.Keeper(tmp_path)
    monkeypatch.setattr(keeper_module, "write_disk_snapshot", no_space)
    monkeypatch.setattr(sys, "stderr", FullDisk())
    for step in (1, 2):
        keeper._disk.put((0, step, keeper_module._Held({}, b"x", readers=1)))
    done = threading.Event()
    threading.Thread(target=lambda: (keeper.flush(), done.set()), daemon=True).start()
    assert done.wait(10), "the disk writer died: flush waits forever"
    assert keeper._writer.is_alive()


def test_a_hand_over_leaves_out_the_tensors_the_receiver_holds_and_puts_its_own_back():
    """``without_leaves`` / ``with_leaves``: the tensors at the held paths travel as markers and
    come back as copies of the receiver's own; small ones and plain values always travel."""
    from collections import OrderedDict

    from geotrain.ft.state import Held, leaf_digests, tensor_digest, with_leaves, without_leaves

    big = torch.arange(512, dtype=torch.float32)
    ordered, own = OrderedDict(w=big + 1), OrderedDict(w=big + 1)
    ordered._metadata = {"": {"version": 2}}
    leader = {
        "global": [big, big * 2],
        "opt": {0: {"m": big * 3}},
        "small": torch.ones(3),
        "n": 7,
        "o": ordered,
    }
    mine = {
        "global": [big.clone(), big * 5],
        "opt": {0: {"m": big * 3}},
        "small": torch.ones(3),
        "n": 1,
        "o": own,
    }
    ours, theirs = leaf_digests(leader), leaf_digests(mine)
    assert ("small",) not in ours and set(ours) == {("global", 0), ("global", 1), ("opt", 0, "m"), ("o", "w")}
    held = {path for path, d in ours.items() if theirs.get(path) == d}
    assert held == {("global", 0), ("opt", 0, "m"), ("o", "w")}
    sent = decode(encode(without_leaves(leader, held)))
    assert sent["global"][0] == Held(("global", 0)) and torch.equal(sent["global"][1], big * 2)
    assert sent["o"]._metadata == {"": {"version": 2}}
    got = with_leaves(sent, mine)
    assert type(got["o"]) is OrderedDict and got["o"]._metadata == {"": {"version": 2}}
    assert tensor_digest(got) == tensor_digest({**leader, "n": 7})
    assert got["global"][0] is not mine["global"][0]  # a copy: loading it leaves the source alone
    with pytest.raises(CorruptSnapshot, match="lacks"):
        with_leaves(sent, {"global": []})


@pytest.mark.parametrize(
    "algo, options, defers",
    [
        ("diloco", {"H": 4}, True),
        ("localsgd", {"H": 4}, True),
        ("sparseloco", {"H": 4, "chunk": 256, "k": 8}, True),
        ("diloco", {"H": 4, "warm_start": 10}, False),  # every step a collective, for now
        ("diloco", {"H": 4, "pace": "time"}, False),  # the joiner's quota would weigh in its sync
        ("diloco", {"H": 1}, False),
        # its mean lands tau steps into the period: the joiner sends an empty message there
        ("co2", {"H": 4, "tau": 2}, True),
        ("streaming", {"H": 8}, False),
        ("dreamddp", {"H": 4}, False),
        ("ssgd", {}, False),
    ],
)
def test_an_admission_is_deferred_only_where_no_collective_but_a_landing_comes_before_the_next_sync(
    algo, options, defers
):
    """``defers_admission``: the members train on while a joiner receives their state only where
    they meet it nowhere before their next sync (``ft/elastic.py``, ``regroup``), or only at the
    landing of a message in flight, where the joiner sends an empty one (SparseLoCo, CO2:
    ``places_by_message``)."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = build_sync(algo, model, opt, Communicator(), options)
    assert sync.defers_admission() is defers
