"""Snapshots with redundancy on real gloo groups: lost hosts are rebuilt bitwise from their peers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from helpers import run_workers


def _start_keeper(tmp: str, name: str):
    from geotrain.ft.keeper import KeeperClient, serve, wait_ready

    sock = Path(tmp) / name
    threading.Thread(target=serve, args=(sock, None, 0.0), daemon=True).start()
    wait_ready(sock)
    return KeeperClient(sock)


def _train_with_snapshots(snaps, seed: int, members: list[int] | None = None, steps: int = 6) -> dict:
    """``steps`` local-SGD steps of the tiny GPT on this worker's data (``seed``), a snapshot at every
    step ``snaps`` says is due, each shipped before the next (training would skip a busy one).
    Returns the states taken, by step."""
    from geotrain.comm.communicator import Communicator
    from geotrain.ft.state import capture
    from geotrain.models.gpt import GPT, gpt_config
    from geotrain.sync import build_sync

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = build_sync("localsgd", model, opt, Communicator(), {"H": 2})
    gen = torch.Generator().manual_seed(seed)
    states = {}
    for step in range(1, steps + 1):
        xy = torch.randint(0, 256, (2, 17), generator=gen)
        _, loss = sync.model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        sync.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync.after_step()
        if snaps.due(step):
            states[step] = capture(
                step=step, model=model, optimizer=opt, sync=sync, generators={"sampler": gen},
                progress={}, replicated=sync.replicated_parts(),
            )  # fmt: skip
            snaps.take(step, lambda copy, state=states[step]: state, members=members)
            snaps.wait()
    snaps.close()
    return states


def _snapshot_then_lose(rank, world_size, tmp: str, spec: str, lost: list[int], steps: int = 6):
    import torch.distributed as dist

    from geotrain.comm.communicator import Communicator
    from geotrain.ft.snapshots import SnapshotConfig, Snapshotter, restore
    from geotrain.ft.state import tensor_digest

    keeper = _start_keeper(tmp, f"k{rank}.sock")
    snap_comm = Communicator(group=dist.new_group(backend="gloo"))
    snaps = Snapshotter(
        SnapshotConfig(every=2, redundancy=spec, keeper=str(keeper.path)),
        rank,
        world_size,
        snap_comm,
        control=Communicator(),
    )
    states = _train_with_snapshots(snaps, seed=rank, steps=steps)
    digests = {
        step: {p: tensor_digest(v) for p, v in sorted(state["parts"].items())}
        for step, state in states.items()
    }
    sent_by_snapshots = snap_comm.stats.sent_bytes
    dist.barrier()
    if rank in lost:  # the host vanished with its keeper: a fresh, empty one stands in
        keeper.stop()
        keeper = _start_keeper(tmp, f"k{rank}-new.sock")
    dist.barrier()
    state, source = restore(rank, world_size, keeper, None, snap_comm)
    got = {p: tensor_digest(v) for p, v in sorted(state["parts"].items())}
    keeper.stop()
    return {
        "step": state["step"],
        "source": source,
        "equal": got == digests[state["step"]],
        "unique_bytes": snaps.stats.unique_bytes,
        "full_bytes": snaps.stats.full_bytes,
        "sent": sent_by_snapshots,
        "recycled": snaps.stats.recycled,
        "shipped": list(snaps.shipped),
    }


@pytest.mark.parametrize(
    "world_size,spec,lost",
    [(3, "ring", [1]), (4, "ec:2/3", [1]), (4, "ec:2/3", [1, 2])],
)
def test_a_lost_host_is_rebuilt_bitwise_from_its_peers(tmp_path, world_size, spec, lost):
    results = run_workers(_snapshot_then_lose, world_size, str(tmp_path), spec, lost, timeout=180)
    for rank, r in enumerate(results):
        assert r["step"] == 6
        assert r["source"] == ("peers" if rank in lost else "keeper")
        assert r["equal"], f"rank {rank} restored something other than what it snapshotted"
        # Only the unique state travels: parameters are equal after the sync at step 6.
        assert r["unique_bytes"] < 0.8 * r["full_bytes"]
    k, n = (1, 1) if spec == "ring" else (2, 3)
    # Three snapshots, each sending n pieces of unique/k bytes (plus small framing).
    expected = 3 * results[0]["unique_bytes"] * n / k
    assert expected <= results[0]["sent"] <= expected * 1.05 + 3 * 4096


def test_snapshots_written_into_recycled_files_ship_and_rebuild_a_lost_host_bitwise(tmp_path):
    """Five snapshots with ring redundancy: the keeper hands back the files of those it let go
    (after their shipments were committed), later snapshots are written into them, shipped
    from them, and a lost host is rebuilt from its peers' pieces of the last one, bitwise."""
    results = run_workers(_snapshot_then_lose, 3, str(tmp_path), "ring", [1], 10, timeout=180)
    for rank, r in enumerate(results):
        assert r["step"] == 10 and r["shipped"] == [2, 4, 6, 8, 10]
        assert r["source"] == ("peers" if rank == 1 else "keeper")
        assert r["equal"], f"rank {rank} restored something other than what it snapshotted"
        assert r["recycled"] >= 1


def _redundancy_after_a_membership_change(rank, world_size, tmp: str, members: list[int]):
    """Hosts ``members`` of a 4-host run train on after host 1 was lost: their snapshots ship
    to each other over the new epoch's snapshot group, named by host, not by rank."""
    import torch.distributed as dist

    from geotrain.comm.communicator import Communicator
    from geotrain.ft.redundancy import Redundancy
    from geotrain.ft.snapshots import SnapshotConfig, Snapshotter, availability
    from geotrain.ft.state import decode, split, tensor_digest

    host = members[rank]
    keeper = _start_keeper(tmp, f"k{host}.sock")
    # Built as in the first epoch of 4 hosts, without a group to ship on (as a joiner is), then
    # regrouped: ring redundancy among the three.
    snaps = Snapshotter(
        SnapshotConfig(every=2, redundancy="ring", keeper=str(keeper.path)),
        host,
        4,
        None,
        control=Communicator(),
    )
    snaps.regroup(Communicator(group=dist.new_group(backend="gloo")), members)
    states = _train_with_snapshots(snaps, seed=host, members=members)
    mine = availability(host, keeper, None)
    # The piece this keeper holds for the host before it in the ring, rebuilt.
    before = members[(rank - 1) % len(members)]
    piece = keeper.get("piece", before, 6, 0)
    held = tensor_digest(decode(Redundancy(1, 1, "ring").rebuild([piece]), "piece"))
    keeper.stop()
    unique = tensor_digest(split(states[6])[1])
    return {"host": host, "avail": mine, "unique": unique, "held_for": before, "held": held,
            "shipped": snaps.shipped, "sent": snaps.sent_bytes()}  # fmt: skip


def test_redundancy_goes_on_among_the_members_of_a_new_epoch(tmp_path):
    """After host 1 of 4 is lost, hosts 0, 2, 3 ship ring copies to each other by host id: each
    holds its ring predecessor's unique state exactly, and a resume that finds host 3's keeper
    and disk gone rebuilds it from host 0's copy while host 1 comes back from a member's state."""
    from geotrain.ft.snapshots import choose_step

    members = [0, 2, 3]
    results = run_workers(_redundancy_after_a_membership_change, 3, str(tmp_path), members, timeout=180)
    by_host = {r["host"]: r for r in results}
    for r in results:
        assert r["shipped"] == [2, 4, 6] and r["sent"] > 0
        assert r["held"] == by_host[r["held_for"]]["unique"]  # host 0 holds 3's, 2 holds 0's, 3 holds 2's
    assert {r["host"]: r["held_for"] for r in results} == {0: 3, 2: 0, 3: 2}
    nothing = {"keeper": [], "disk": [], "pieces": [], "members": {}}
    avail = [by_host[0]["avail"], nothing, by_host[2]["avail"], nothing]  # host 3 lost whole
    assert choose_step(avail) == (6, {0: "keeper", 1: "member", 2: "keeper", 3: "peers"})
