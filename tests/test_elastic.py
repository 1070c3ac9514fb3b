"""Membership epochs and regrouping (``--on-failure continue``), below the CLI.

Pure logic first (the shard deal, the step agreement, abandoning a wait), then the coordinator's
epochs on a real TCPStore, then real gloo processes that lose a member and regroup: the survivor
that fell behind adopts the leader's state bitwise, and a failed periodic average is redone over
the survivors with its closed-form result.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
import threading
import time
import traceback
import types
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from geotrain.comm.buckets import flatten
from geotrain.comm.communicator import Communicator, peer_lost_line, wait_work
from geotrain.data.corpus import BatchSampler, TokenCorpus
from geotrain.ft.elastic import (
    StepStatus,
    catching_up,
    copies_at_the_end,
    next_boundary,
    owned_shards,
    regroup,
)
from geotrain.ft.keeper import KeeperError
from geotrain.ft.membership import Excluded, Membership, MembershipChanged
from geotrain.launch.coordinator import Epochs, read_epochs
from helpers import CONTEXT


def test_the_shards_of_lost_hosts_are_dealt_to_the_survivors_each_exactly_once():
    for members in ([0, 1, 2, 3], [1, 2, 3], [1, 3], [2]):
        deal = {h: owned_shards(h, 4, members) for h in members}
        assert sorted(s for shards in deal.values() for s in shards) == [0, 1, 2, 3]
        assert all(shards[0] == h for h, shards in deal.items())  # its own first
    assert owned_shards(1, 4, [1, 3]) == [1, 0] and owned_shards(3, 4, [1, 3]) == [3, 2]


def test_a_sampler_reads_only_the_shards_it_holds_and_never_across_two():
    train = np.repeat(np.arange(4, dtype=np.uint16), 1000)  # shard k is all k
    corpus = TokenCorpus(train, np.zeros(200, dtype=np.uint16), 256, "test")
    sampler = BatchSampler(corpus, block_size=16, batch_size=64, rank=1, world_size=4, seed=0)
    assert set(sampler.next_train()[0].unique().tolist()) == {1}
    sampler.read_shards([1, 3])
    x, _ = sampler.next_train()
    assert set(x.unique().tolist()) == {1, 3}
    assert all(len(row.unique()) == 1 for row in x)


def test_the_agreed_point_is_the_furthest_any_survivor_got():
    assert max([StepStatus(4, True), StepStatus(5, False), StepStatus(4, False)]) == StepStatus(5, False)
    assert StepStatus(4, True) > StepStatus(4, False)


def test_too_few_members_pause_together_at_the_boundary_the_furthest_heads_for():
    S = StepStatus
    # H=10: one stopped right after the sync of step 10, another at 13: both go on to 20.
    assert next_boundary([S(10, False), S(13, False)], [], 10) == 20
    assert next_boundary([S(10, False), S(10, False)], [], 10) == 10
    assert next_boundary([S(19, True), S(17, False)], [], 10) == 20  # the redone average is 20
    # Those behind go on from the leader's step; per-step methods pause where they go on.
    assert next_boundary([S(20, False), S(19, True)], [1], 10) == 20
    assert next_boundary([S(7, False), S(7, False)], [], 1) == 7


def test_who_adopts_the_leaders_state():
    S = StepStatus
    # Per-step methods: everyone not at the furthest step.
    assert catching_up([S(5, False), S(4, False), S(5, False)], 1) == [1]
    assert catching_up([S(5, False), S(5, False)], 1) == []
    # Periodic (H=10): local steps drift between syncs; the same syncs done is consistent,
    # an averaging that failed (19, True) is met by a member still before it (17, False).
    assert catching_up([S(13, False), S(16, False), S(11, False)], 10) == []
    assert catching_up([S(19, True), S(17, False)], 10) == []
    # ...but one that finished the averaging (20) leads those whose copy of it failed (19, True).
    assert catching_up([S(19, True), S(20, False), S(19, True)], 10) == [0, 2]
    # A joiner (-1) is behind every sync.
    assert catching_up([S(20, False), S(20, False), S(-1, False)], 10) == [2]
    assert catching_up([S(3, False), S(-1, False)], 10) == [1]
    # The final average (20 steps, H=4): done on host 0 (it reports 20 + H), failed on host 1.
    assert catching_up([S(24, False), S(20, False)], 4) == [1]
    assert catching_up([S(21, False), S(20, False)], 1) == [1]
    # A sync that lands the message in flight and then gathers (SparseLoCo's timed outer step):
    # one survivor landed it before the gather failed, the other's wait failed. The first is
    # further: the second (and one still before that sync) would send the message again.
    assert S(19, True, 1) > S(19, True) and S(19, True, 1) < S(20, False)
    assert catching_up([S(19, True, 1), S(19, True, 0), S(17, False)], 10) == [1, 2]
    assert catching_up([S(19, True, 1), S(19, True, 1)], 10) == []
    assert catching_up([S(19, True, 0), S(19, True, 1)], 1) == [0]
    # Inside an end-of-run average of several stages (Streaming DiLoCo's fragments), the one
    # further in it leads, whatever the period: the others would redo an earlier stage.
    assert S(20, False, False, 2) > S(20, False, True, 1) and S(20, False, False, 2) < S(24, False)
    assert catching_up([S(20, False, False, 2), S(20, False, False, 1)], 4) == [1]
    assert catching_up([S(20, False, False, 2), S(20, False, False, 2)], 4) == []


class _Work:
    def __init__(self, polls_to_finish: int | None, error: str = "") -> None:
        self.left, self.error = polls_to_finish, error

    def is_completed(self) -> bool:
        return self.left is not None and self.left <= 0

    def wait(self, timeout=None) -> bool:
        if self.left is not None:
            self.left -= 1  # it completes during this wait, or not
        if self.is_completed():
            if self.error:
                raise RuntimeError(self.error)
            return True
        raise RuntimeError("Operation timed out!")


class _RacyWork(_Work):
    """Completes just as a wait times out: the timeout's error must not be taken for its own."""

    def wait(self, timeout=None) -> bool:
        if timeout is not None and not self.is_completed():
            self.left = 0
            raise RuntimeError("Operation timed out!")
        return super().wait(timeout)


def test_only_the_result_of_a_landing_is_sent_where_that_is_all_the_others_lack():
    from geotrain.ft.flight import only_a_landing_behind

    S, meta = StepStatus, ([3, 100], "uint8", 3)
    assert only_a_landing_behind([S(19, True, 1), S(19, True, 0)], [1], meta)
    assert only_a_landing_behind([S(20, False, 1, 2), S(20, False, 0, 2), S(20, False, 0, 2)], [1, 2], meta)
    assert not only_a_landing_behind([S(19, True, 1), S(19, True, 0)], [1], None)  # nothing kept
    assert not only_a_landing_behind([S(19, True, 1), S(17, False, 0)], [1], meta)  # before the sync
    assert not only_a_landing_behind([S(20, False, 1), S(-1, False)], [1], meta)  # a joiner
    assert not only_a_landing_behind([S(20, False, 0, 2), S(20, False, 1, 1)], [1], meta)  # a stage
    assert not only_a_landing_behind([S(19, True, 1), S(19, True, 1)], [], meta)
    # (regroup sends it only where the redo lands it at once, each survivor at its old rank,
    # without the norm check: the other gloo test, the end-of-run average, hands the state over)


def test_only_the_landing_the_leader_went_on_from_is_sent_to_a_member_a_place_behind():
    from geotrain.ft.flight import a_landing_behind_the_leader as behind_the_leader

    S, meta = StepStatus, ([3, 100], "uint8", 3)
    statuses = [S(9, False), S(7, True), S(9, False)]  # host 1's wait for its landing at 8 failed
    places, keeps = [(2, 0), (1, 0), (2, 0)], [False, False, False]
    assert behind_the_leader(statuses, places, keeps, [1], 0, meta) == [1]
    assert not behind_the_leader(statuses, places, keeps, [1], 0, None)  # nothing kept
    assert not behind_the_leader(
        statuses, places, [True, False, False], [1], 0, meta
    )  # leader lands a kept one
    assert not behind_the_leader(statuses, [(3, 0), (1, 0), (3, 0)], keeps, [1], 0, meta)  # two places behind
    assert not behind_the_leader(
        [S(9, False), S(7, False), S(9, False)], places, keeps, [1], 0, meta
    )  # no failed sync
    assert not behind_the_leader(
        [S(9, False), S(7, True, True), S(9, False)], places, keeps, [1], 0, meta
    )  # landed
    # one behind is at the leader's place, a step short of it: it needs nothing, the other the
    # landing (2 of the 22 fault regroups of a CO2 soak handed the state to both)
    statuses = [S(9, False), S(7, True), S(8, False)]
    assert behind_the_leader(statuses, places, keeps, [1, 2], 0, meta) == [1]
    assert not behind_the_leader(
        statuses, [(2, 0), (1, 0), (1, 0)], keeps, [1, 2], 0, meta
    )  # the other a place behind with no failed sync: it lacks more
    assert not behind_the_leader(
        statuses, [(2, 0), (2, 0), (2, 0)], keeps, [1, 2], 0, meta
    )  # none lacks a landing
    assert not behind_the_leader(statuses, places, keeps, [1], 0, ([3, 100], "uint8", 256))


def test_survivors_are_placed_by_the_message_they_send_first_in_the_new_group():
    """H=4. Host 0 past the sync at 8, its message in flight (not arrived: the lost host never
    sent its part); host 1 at step 7, short of it. Its own message in flight (a period late)
    arrived everywhere: kept, it lands from what arrived and both are at the place of step 8's
    message; not arrived, it sends step 4's again, a place behind. With nothing in flight (the
    last landing inside the period) host 1 is at step 8's place."""
    from geotrain.ft.elastic import _places

    S = StepStatus
    statuses = [S(9, False), S(7, False)]
    assert _places(statuses, [False, True], 4, True) == ([(2, 0), (2, 0)], [False, True])
    assert _places(statuses, [False, False], 4, True) == ([(2, 0), (1, 0)], [False, False])
    statuses = [S(9, False), S(7, False, True)]
    places, keeps = _places(statuses, [False, None], 4, True)
    assert places == [(2, 0), (2, 0)] and keeps == [False, False]
    assert catching_up(statuses, 4, places) == []
    # placed by their periods (the algorithms that do not place by message): apart
    places, _ = _places(statuses, [False, None], 4, False)
    assert catching_up(statuses, 4, places) == [1]


def test_an_epochs_group_forms_within_a_minute_and_then_waits_the_collective_timeout(monkeypatch):
    """A member lost while the group forms (registered, then killed) must fail the others within
    the formation's minute, not the collective timeout (hours on a slow link): the default group
    is made under FORMATION_S, then given the collective timeout."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    from geotrain.ft import membership as membership_module

    made, set_to = [], []
    world = distributed_c10d._world
    monkeypatch.setattr(world, "group_count", 1)  # as a failed formation leaves torch's count
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "PrefixStore", lambda prefix, store: prefix)
    monkeypatch.setattr(tdist, "init_process_group", lambda backend, **kw: made.append(kw))
    monkeypatch.setattr(distributed_c10d, "_set_pg_timeout", lambda t, group=None: set_to.append(t))
    monkeypatch.setattr(Membership, "store", lambda self: None)
    m = Membership("127.0.0.1", 1, 2, [0, 1, 2], timeout_s=6036)
    m.join(3, [0, 2])
    (kw,) = made
    assert kw["timeout"].total_seconds() == membership_module.FORMATION_S and kw["rank"] == 1
    assert isinstance(kw["store"], membership_module.FormationStore)  # its waits: the same minute
    assert kw["store"].inner == "geotrain/epoch3" and kw["store"].bound_s == membership_module.FORMATION_S
    assert [t.total_seconds() for t in set_to] == [6036]
    assert (m.epoch, m.members) == (3, [0, 2])
    assert world.group_count == 0  # the new default group is named, so keyed, as its peers' is
    m.published_leave = 5  # epoch 4 lost members before this worker formed it: not even tried
    with pytest.raises(MembershipChanged, match="epoch 4 lost members before"):
        m.join(4, [0, 2])
    assert len(made) == 1


class _Keys:
    """A store holding ``keys`` (what a formation's waits poll), and what was asked of it."""

    def __init__(self, keys: set[str]) -> None:
        self.keys, self.checks = keys, 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return set(keys) <= self.keys

    def get(self, key: str) -> bytes:
        return key.encode()


def test_a_formations_wait_gives_up_at_its_bound_or_at_once_when_a_newer_epoch_lost_members():
    from geotrain.ft.membership import FormationStore

    inner, lost = _Keys({"0"}), []
    store = FormationStore(inner, lambda: bool(lost), bound_s=0.3)
    assert store.get("0") == b"0"  # there: no wait
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="wait timeout after 0 s") as e:
        store.wait(["0", "1"], timedelta(seconds=0.01))  # gloo's timeout is not the store's bound
    assert not isinstance(e.value, MembershipChanged) and 0.3 <= time.monotonic() - t0 < 1.0
    lost.append(2)
    t0 = time.monotonic()
    with pytest.raises(MembershipChanged, match="newer epoch lost members"):
        store.get("1")
    assert time.monotonic() - t0 < 0.25  # no poll's sleep first


def _publish(store, epoch: int, members: str, kind: str) -> None:
    """An epoch as the coordinator publishes it (``launch/coordinator.Epochs``)."""
    store.set(f"members/{epoch}", members)
    store.set(f"kind/{epoch}", kind)
    store.add("epoch", 1)


def _forming_twice(host: int, store_port: int, out: str) -> None:
    """Host 0 forms epoch 1 of hosts 0 and 1; host 1 never comes (lost after it said it was
    ready), and epoch 2 says so. Then epoch 3 admits host 1 (a fresh process): both form it. A
    heartbeat thread reads the epochs, as a trainer's does."""
    from geotrain.ft import membership as membership_module

    membership = Membership("127.0.0.1", store_port, host, [0, 1], timeout_s=600)
    beat = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    stop = threading.Event()
    wait = membership_module.FormationStore.wait

    def marked_wait(self, keys, timeout=None):  # the test publishes the loss once this waits
        beat.set(f"forming/{host}", "1")
        return wait(self, keys, timeout)

    membership_module.FormationStore.wait = marked_wait

    def heartbeat() -> None:
        while not stop.wait(0.1):
            membership.observe(beat, int(beat.add("epoch", 0)))

    threading.Thread(target=heartbeat, daemon=True).start()
    result: dict = {}
    try:
        if host == 0:
            try:
                membership.join(1, [0, 1])
                result["formed"] = True
            except RuntimeError as e:
                result.update(error=str(e), type=type(e).__name__, ended=time.time())  # the test's clock
            beat.set("abandoned/0", "1")
        membership.join(3, [0, 1])
        t = torch.full((2,), float(host + 1))
        dist.all_reduce(t)
        result["sum"] = t
        dist.destroy_process_group()
    except BaseException:
        result["traceback"] = traceback.format_exc()
    stop.set()
    torch.save(result, out)


def test_a_formation_waiting_for_a_member_that_died_gives_up_as_soon_as_a_newer_epoch_is_published(tmp_path):
    """A member that said it was ready for an epoch and died before posting its address held
    the others in the formation for its whole bound (a minute), so kills 20 s apart stalled a
    soak. The coordinator publishes the loss within seconds: the formation gives up then. And
    the worker whose formation failed forms the next epoch with a peer that never failed one
    (torch's count of unnamed groups, which names the default group's keys, is reset)."""
    store = _master()
    _publish(store, 1, "0,1", "leave")
    outs = [str(tmp_path / f"host{h}.pt") for h in range(2)]
    procs = [
        CONTEXT.Process(target=_forming_twice, args=(h, store.port, outs[h]), daemon=True) for h in range(2)
    ]
    procs[0].start()
    try:
        deadline = time.monotonic() + 60
        while not store.check(["forming/0"]):  # host 0 waits in epoch 1's formation
            assert time.monotonic() < deadline and procs[0].is_alive()
            time.sleep(0.05)
        time.sleep(0.5)
        published = time.time()
        _publish(store, 2, "0", "leave")  # host 1 is lost
        while not store.check(["abandoned/0"]):
            assert time.monotonic() < deadline and procs[0].is_alive()
            time.sleep(0.05)
        _publish(store, 3, "0,1", "join")  # its replacement
        procs[1].start()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    first, second = (torch.load(o, weights_only=False) for o in outs)
    assert first.get("type") == "MembershipChanged" and "newer epoch lost members" in first["error"], first
    assert first["ended"] - published < 2.0, first  # at once, where it waited out FORMATION_S (60 s)
    for got in (first, second):
        assert torch.equal(got.get("sum", torch.zeros(2)), torch.full((2,), 3.0)), got


def test_a_primed_result_lands_without_sending_and_a_new_regroup_drops_it():
    from geotrain.sync.base import InFlight

    own, result = torch.tensor([1, 2], dtype=torch.uint8), torch.arange(6, dtype=torch.uint8).reshape(3, 2)
    f = InFlight(comm=None, keeps_landed=True)
    f._resend = own  # its wait failed; a regroup's rebind keeps it to send again
    f.prime(result)
    assert f.flying and f.primed and not f.resending and f.saved() is own
    assert f.land() is result and not f.flying and f.landings == 1 and f.last_landed is result
    f._resend = own
    f.prime(result)
    f.unprime()  # the regroup that primed it failed: its own message goes out again
    assert not f.primed and f.resending and f.saved() is own


def test_a_result_from_another_group_is_judged_as_the_hosts_that_sent_its_rows():
    """``InFlight`` records the hosts of the group each collective ran in: a result primed (kept
    at a regroup, or sent by another survivor) lands with those hosts, a resend on the new group
    with the new group's, a result restored from a state with the hosts saved beside it. In
    ``judging_rows_of`` the norm check reads the rows as those hosts' (a rejection counted
    against the host that sent the row) and this group's left-out ranks apply to none of them."""
    from geotrain.sync.base import InFlight

    membership = types.SimpleNamespace(members=[5, 7, 9])
    comm = types.SimpleNamespace(
        rank=1, world_size=3, membership=membership, all_gather=lambda t, async_op: None
    )
    comm.group_hosts = lambda: Communicator.group_hosts(comm)  # (the Communicator's own reading)
    f = InFlight(comm)
    f.launch(torch.ones(2, dtype=torch.uint8))
    assert f.sent_as == (1, 3) and f.sent_hosts == (5, 7, 9)
    f.rebind()  # a regroup: hosts 5 and 7 go on
    membership.members, comm.rank, comm.world_size = [5, 7], 1, 2
    f.prime(torch.zeros(3, 2, dtype=torch.uint8))  # the gather arrived whole on the other
    assert f.primed_hosts == (5, 7, 9)
    f.land()
    assert f.landed_hosts == (5, 7, 9) and isinstance(f.rows_judged(), contextlib.AbstractContextManager)
    g = InFlight(comm)
    g.restore(torch.ones(2, dtype=torch.uint8), None, torch.zeros(3, 2, dtype=torch.uint8), [5, 9, 7])
    assert g.primed_hosts == (5, 9, 7) and g.sent_hosts is None
    g.unprime()  # (a new regroup drops it: its own message is sent again, on that group)
    assert g.resending and g.primed_hosts is None

    # --max-norm-ratio auto (10 from 3 workers on): in a group of two only finiteness is judged
    checked = Communicator(membership=membership, max_norm_ratio=10.0, auto_min_workers=3)
    checked.world_size, checked.rank = 2, 0
    checked.max_norm_ratio = checked.ratio_for(2)
    judged = [(1.0, True), (500.0, True), (1.2, True)]  # three rows of the group before
    assert checked.max_norm_ratio == math.inf and checked.weigh_gathered(judged[:2]) == [1.0, 1.0]
    checked.left_out = frozenset({1})
    with checked.judging_rows_of((5, 9, 7)):  # judged as among the three that sent them: at 10
        weights = checked.weigh_gathered(judged)
    assert weights == [1.0, 0.0, 1.0]  # row 1 judged (not left out as this group's rank 1) and rejected
    assert checked.max_norm_ratio == math.inf  # (this group's again)
    assert checked.rejected_by_rank == {9: 1} and checked.step_checked == {5, 9, 7}


def test_a_regroup_forgets_the_verdicts_of_a_step_cut_short_but_not_a_landings():
    """The norm check's verdicts of a step a failure cut short are dropped at the regroup (the
    step is redone and judged again), but those of a landing of a message in flight
    (``InFlight.rows_judged``), which the regroup keeps where a survivor landed it; the step's
    verdicts are taken once for ``--max-rejections``."""
    membership = types.SimpleNamespace(members=[5, 7, 9])
    checked = Communicator(membership=membership, max_norm_ratio=10.0)
    checked.world_size, checked.rank = 3, 0
    with checked.judging_a_landing():  # a gather in flight landed: host 7's row rejected
        assert checked.weigh_gathered([(1.0, True), (500.0, True), (1.2, True)]) == [1.0, 0.0, 1.0]
    assert checked.weigh_gathered([(1.0, True), (1.1, True), (900.0, True)]) == [1.0, 1.0, 0.0]
    assert checked.step_checked == {5, 7, 9} and checked.step_rejected == {7, 9}
    checked.forget_cut_verdicts()  # the regroup: the second judged a collective that is redone
    assert checked.step_checked == {5, 7, 9} and checked.step_rejected == {7}
    assert checked.take_step_verdicts() == ({5, 7, 9}, {7})
    assert checked.take_step_verdicts() == (set(), set())
    checked.forget_cut_verdicts()  # (a landing's verdicts are the step's, taken with it)
    assert checked.step_checked == set() and checked.rejected_by_rank == {7: 1, 9: 1}


def test_a_collective_put_back_after_a_load_keeps_its_rank_and_is_not_timed():
    """``take_live``: a joiner's empty part of the members' landing, launched before it loaded
    their state (which drops it), is in flight again with the rank it was sent as, and its
    wait is no measure of the link (SparseLoCo's auto landing) until its next launch."""
    from geotrain.sync.base import InFlight

    class Sent:  # a gather's handle and a communicator of rank 2 of 3
        rank, world_size = 2, 3

        def all_gather(self, payload, async_op=False):
            return types.SimpleNamespace(wait=lambda: payload.expand(3, -1), is_completed=lambda: True)

    f = InFlight(comm=Sent())
    f.launch_empty([4], "uint8", torch.device("cpu"))
    live = f.live()
    assert not f.untimed and f.sent_as == (2, 3)
    f.restore(torch.ones(4, dtype=torch.uint8))  # the loaded state: the leader's message to send
    assert f.resending and f.sent_as is None
    f.take_live(live)
    assert f.untimed and not f.resending and f.sent_as == (2, 3) and f.own_row(3) == 2
    assert torch.equal(f.land(), torch.zeros(3, 4, dtype=torch.uint8)) and not f.untimed
    f.launch(torch.ones(4, dtype=torch.uint8))
    assert not f.untimed


def test_a_result_kept_from_its_own_collective_is_in_flight_again_after_a_failed_regroup():
    """``keep_arrived``: the collective completed here (on a group left since) lands its result,
    nothing sent; a regroup that fails before it lands puts that collective back in flight (its
    result still here: kept again, not sent again). An adopter of a state holding such a result
    keeps none of the other worker's message: a later regroup would send it again as its own.
    And a collective that completed with an error has not arrived."""
    from geotrain.sync.base import InFlight

    result = torch.arange(6, dtype=torch.uint8).reshape(3, 2)

    class Done:
        def __init__(self, error: bool = False) -> None:
            self.error = error

        def is_completed(self) -> bool:
            return True

        def wait(self):
            if self.error:
                raise RuntimeError("a lost peer")
            return result

    f = InFlight(comm=None)
    own = torch.tensor([1, 2], dtype=torch.uint8)
    f._handle, f._payload = Done(), own
    assert f.arrived_intact()
    f.keep_arrived()
    assert f.primed and f.primed_result is result and f.saved() is own
    f.unprime()
    assert not f.primed and not f.resending and f.arrived_intact()  # in flight again, not to send
    f.keep_arrived()
    assert f.land() is result and not f.flying
    g = InFlight(comm=None)
    g.restore(own)
    g.prime(result)  # a state with a kept result, loaded (``SparseLoCo.load_state_dict``)
    g.adopted()
    assert torch.equal(g.saved(), torch.zeros_like(own)) and g.primed_result is result
    h = InFlight(comm=None)
    h._handle, h._payload = Done(error=True), own
    assert not h.arrived_intact()


def test_the_end_of_run_average_leaves_out_who_adopted_at_the_end_and_not_before():
    event = {"members": [0, 2, 3], "behind": [3], "leader": 0, "furthest": 100}
    assert copies_at_the_end([event], 100) == {2}  # the leader was in the average: rank 2 a copy
    assert copies_at_the_end([event | {"furthest": 104}], 100) == {2}  # ... or had finished it
    assert copies_at_the_end([event | {"furthest": 96}], 100) == set()  # it trained 4 steps since
    assert copies_at_the_end([], 100) == set()
    # A second regroup inside the average (host 2 lost, nobody behind): host 3 is still a copy.
    second = {"members": [0, 3, 4], "behind": [], "leader": 0, "furthest": 100}
    assert copies_at_the_end([event, second], 100) == {1}
    # Its leader lost too: the copy stands in for it (its replica is the only one of that
    # progress), unless adopters start from the shared state (they hold none of it).
    third = {"members": [3, 4], "behind": [], "leader": 3, "furthest": 100}
    assert copies_at_the_end([event, second, third], 100) == set()
    assert copies_at_the_end([event, second, third], 100, stands_in=False) == {0}
    # two copies of a leader gone: one stands in, once
    both = {"members": [0, 1, 2, 3], "behind": [2, 3], "leader": 0, "furthest": 100}
    after = {"members": [1, 2, 3], "behind": [], "leader": 1, "furthest": 100}
    assert copies_at_the_end([both], 100) == {2, 3} and copies_at_the_end([both, after], 100) == {2}


def test_copies_held_after_a_failed_redo_are_left_out_while_their_leader_is_a_member():
    from geotrain.ft.elastic import held_copies

    S = StepStatus
    members = [0, 1, 2, 3]
    # Hosts 2 and 3 hold copies of host 0's state: left out while host 0 is a member...
    assert held_copies([None, None, 0, 0], [S(9, True)] * 4, members) == {2, 3}
    # ...and once it is gone, one copy stands for it (the lowest rank), once.
    assert held_copies([None, 0, 0], [S(9, True)] * 3, [1, 2, 3]) == {2}
    # A joiner that took host 0's number is not host 0's state.
    assert held_copies([None, None, 0, 0], [S(-1, False)] + [S(9, True)] * 3, members) == {3}
    assert held_copies([None] * 3, [S(9, True)] * 3, [0, 1, 2]) == set()
    # A copy that holds none of the leader's progress (SparseLoCo's adopter starts from the
    # anchor) cannot stand in for it: left out, leader or not.
    assert held_copies([None, 0, 0], [S(9, True)] * 3, [1, 2, 3], stands_in=False) == {1, 2}


def test_a_worker_left_out_of_a_redone_average_sends_an_empty_message():
    """SparseLoCo and CO2 send a message of their own at the outer step: a worker whose copy of
    the leader's state is left out (``Communicator.leaving_out``) sends the empty one, which
    the decoders and the weighted mean leave out, and keeps its error feedback as it was."""
    from geotrain.sync import build_sync

    cases = (
        ("sparseloco", {"H": 2, "overlap": False}),
        ("sparseloco", {"H": 2, "overlap": True}),
        ("co2", {"H": 2}),
        ("co2", {"H": 2, "bits": 4}),
    )
    for algo, options in cases:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        comm = Communicator()
        sync = build_sync(algo, model, optimizer, comm, options)
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            model(torch.randn(4, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if sync.step_count == 1:
                comm.left_out = frozenset({0})  # as leaving_out sets it on a larger group
            sync.after_step()
        comm.left_out = frozenset()
        if algo == "sparseloco":  # the empty payload decodes to nothing: no outer step moved it
            assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
            assert not sync._error.any()
            if options["overlap"]:  # nor stands in for the mean in the start point, and flies empty
                assert torch.equal(sync._start, sync._anchor) and not sync.in_flight.saved().any()
        else:  # its message in flight (fp32, the weight last; or 4-bit), all zero
            assert not sync.in_flight.saved().any()
            if options.get("bits") == 4:  # and what its rounding lost is as it was: nothing
                assert sync.in_flight.saved().dtype == torch.uint8 and not sync._residual.any()
        sync.close()


def test_a_wait_is_abandoned_when_a_new_epoch_is_published_and_a_real_error_is_not_hidden():
    wait_work(_Work(3), interrupt=lambda: False)  # finishes after a few polls
    wait_work(_RacyWork(1), interrupt=lambda: False)
    with pytest.raises(MembershipChanged):
        wait_work(_Work(None), interrupt=lambda: True)  # a frozen peer: never completes
    with pytest.raises(RuntimeError, match="Connection closed by peer") as err:
        wait_work(_Work(1, "Connection closed by peer"), interrupt=lambda: False)
    assert not isinstance(err.value, MembershipChanged)


def test_a_peer_gone_is_one_line_and_other_errors_are_not_taken_for_it():
    gloo = (
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:62126. This is "
        "typically caused by a remote worker crashing."
    )
    line = peer_lost_line(RuntimeError(gloo), 0)
    assert line is not None and line.startswith("host 0: a collective failed, a peer gone (Connection closed")
    assert "\n" not in line and "pair.cc" not in line
    assert peer_lost_line(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), 3)
    assert peer_lost_line(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 0) is None  # a bug
    assert peer_lost_line(ValueError("[gloo/pair.cc] Connection reset by peer"), 0) is None  # not gloo's
    # This host's own keeper gone says the same words: its failure is nobody else's to report.
    assert peer_lost_line(KeeperError("keeper at /tmp/k.sock: [Errno 32] Broken pipe"), 0) is None


def test_gloo_timeouts_either_way_it_words_them_are_one_line_and_no_peer_gone():
    """A transfer past the group's timeout, or one on a connection an earlier timeout closed (a
    frozen peer, seen from DDP's backward both ways), is the timeout's line (test_cli.py's run)."""
    from geotrain.comm.communicator import timeout_line

    for gloo in (
        "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation",
        "[../gloo/transport/tcp/pair.cc:598] Application timeout caused pair closure",
    ):
        line = timeout_line(RuntimeError(gloo), 2, 2.0, "loopback (unshaped)")
        assert line is not None and "waited longer than the collective timeout of 2 s" in line, gloo
        assert peer_lost_line(RuntimeError(gloo), 0) is None
    assert (
        timeout_line(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), 2, 2.0, "") is None
    )


class _Transfer:
    """A point-to-point work as gloo leaves it: ``wait()`` blocks until the transfer ends. gloo
    tells a connection's error to the transfers queued on it, not to the one whose payload it
    is reading (``tcp::Pair::signalException`` skips ``rx_``): a receive from a peer killed
    mid-message waits for the group's timeout. Waited with a timeout, gloo would fail it and
    close the group's connections, so no test here may do that."""

    def __init__(self, after_s: float | None = None, error: str = "") -> None:
        self.ends, self.error, self.waits = threading.Event(), error, []
        if after_s is not None:
            threading.Timer(after_s, self.ends.set).start()

    def is_completed(self) -> bool:
        return False  # gloo's send and receive works say so only once waited

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        assert timeout is None, "a timed-out point-to-point wait closes the group's connections"
        self.ends.wait()
        if self.error:
            raise RuntimeError(self.error)
        return True


def _exchanging_comm(monkeypatch, membership, works):
    """A Communicator of 4 (no real group) whose transfers are ``works``."""
    comm = Communicator(membership=membership)
    comm.world_size, comm.rank, comm.distributed = 4, 2, True
    pending = list(works)
    monkeypatch.setattr(dist, "isend", lambda *a, **k: pending.pop(0))
    monkeypatch.setattr(dist, "irecv", lambda *a, **k: pending.pop(0))
    return comm


def _run(fn, timeout_s: float):
    """``fn()`` in a thread: what it raised (None: returned), or "hung" after ``timeout_s``."""
    out: list = []

    def body():
        try:
            fn()
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else "hung"


def test_a_hand_over_transfer_from_a_peer_killed_mid_message_is_abandoned_for_the_new_epoch(monkeypatch):
    """The 127 s stall of the 300-step soak: a member killed while sending its stripe of the
    joiner's state left the joiner in ``exchange`` (its receive never ends), alive and beating,
    so every epoch after (each waiting for it to be ready) stalled until the next kill."""
    membership = types.SimpleNamespace(epoch=8, published_leave=8)
    stuck = _Transfer()  # the receive from the killed member
    comm = _exchanging_comm(monkeypatch, membership, [_Transfer(0.1), stuck])
    recvs = [(torch.zeros(4), 1, 0), (torch.zeros(4), 3, 0)]
    threading.Timer(0.3, setattr, args=(membership, "published_leave", 9)).start()  # heartbeat
    try:
        t0 = time.monotonic()
        outcome = _run(lambda: comm.exchange([], recvs), timeout_s=5.0)
        assert isinstance(outcome, MembershipChanged), outcome
        assert time.monotonic() - t0 < 2.0
    finally:
        stuck.ends.set()


def test_a_hand_over_transfer_completes_and_reports_its_error_unless_members_were_lost(monkeypatch):
    joining = types.SimpleNamespace(epoch=8, published_leave=8)  # a join epoch interrupts nothing
    works = [_Transfer(0.2), _Transfer(0.1)]
    comm = _exchanging_comm(monkeypatch, joining, works)
    assert _run(lambda: comm.exchange([(torch.zeros(4), 3, 0)], [(torch.zeros(4), 1, 1)]), 5.0) is None
    assert all(w.waits == [None] for w in works)  # waited plainly, each once
    comm = _exchanging_comm(monkeypatch, joining, [_Transfer(0.1, "Connection closed by peer")])
    outcome = _run(lambda: comm.exchange([], [(torch.zeros(4), 1, 0)]), 5.0)
    assert isinstance(outcome, RuntimeError) and not isinstance(outcome, MembershipChanged)
    assert "Connection closed by peer" in str(outcome)


def test_an_exchange_cut_short_says_which_receives_completed_each_peers_apart(monkeypatch):
    """The transfers from each peer are waited on apart from the others': a receive stuck on a
    killed peer hides neither those that completed from a live one (a retried hand-over keeps
    them) nor those of the live peer that complete after the killed one's connection failed."""
    membership = types.SimpleNamespace(epoch=8, published_leave=8)
    stuck, failing = _Transfer(), _Transfer(0.05, "Connection closed by peer")
    late = _Transfer(0.3)  # from the live peer, after the killed one's error
    works = [stuck, _Transfer(0.05), failing, late]  # from peers 3, 1, 3 (queued), 1
    comm = _exchanging_comm(monkeypatch, membership, works)
    recvs = [(torch.zeros(4), r, i) for i, r in enumerate((3, 1, 3, 1))]
    received = [False] * 4
    threading.Timer(1.0, setattr, args=(membership, "published_leave", 9)).start()
    try:
        outcome = _run(lambda: comm.exchange([], recvs, received), timeout_s=5.0)
        assert isinstance(outcome, MembershipChanged), outcome
        assert received == [False, True, False, True]
    finally:
        stuck.ends.set()
    comm = _exchanging_comm(monkeypatch, membership, [_Transfer(0.05, "Connection closed by peer"), late])
    membership.published_leave = 8  # no member lost: the error, once the live peer's completed
    received = [False] * 2
    late.ends.clear()
    threading.Timer(0.3, late.ends.set).start()
    outcome = _run(lambda: comm.exchange([], recvs[:2], received), timeout_s=5.0)
    assert "Connection closed by peer" in str(outcome) and received == [False, True]


def test_receives_are_posted_a_window_at_a_time_and_none_after_the_exchange_is_abandoned(monkeypatch):
    """gloo sends a message once its receive is posted, and a transfer abandoned on the retired
    group goes on: posted all at once, a hand-over cut at 300 kbit/s kept the link busy under its
    retry, which asked again for what had not come (benchmarks/bench_handover_cut.py). Each
    peer's receives go two at a time where the link is slow (WINDOW_S of its rate: none here);
    those posted before the cut complete after it and are flagged; none is posted after it."""
    from geotrain.comm import waits

    monkeypatch.setattr(waits, "WINDOW_S", 0.0)  # the rate never widens the window here
    membership = types.SimpleNamespace(epoch=8, published_leave=8)
    works = [_Transfer() for _ in range(9)]
    posted: list[int] = []

    def irecv(tensor, *args, **kwargs):
        posted.append(int(tensor[0]))
        return works[int(tensor[0])]

    comm = _exchanging_comm(monkeypatch, membership, [])
    monkeypatch.setattr(dist, "irecv", irecv)
    peers = [1, 3, 1, 1, 3, 1, 1, 3, 1]  # six from peer 1, three from peer 3
    recvs = [(torch.full((4,), float(i)), r, i) for i, r in enumerate(peers)]
    received = [False] * 9
    outcome: list = []
    exchange = functools.partial(comm.exchange, [], recvs, received)
    thread = threading.Thread(target=lambda: outcome.append(_run(exchange, 5.0)))
    thread.start()

    def settled(n: int) -> list[int]:
        deadline = time.monotonic() + 2.0
        while len(posted) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # and no more than that
        return sorted(posted)

    assert settled(4) == [0, 1, 2, 4]  # the first two of each peer's
    works[0].ends.set()  # one of peer 1's arrives: its next is asked for
    assert settled(5) == [0, 1, 2, 3, 4]
    works[2].ends.set()
    works[3].ends.set()
    assert settled(7) == [0, 1, 2, 3, 4, 5, 6]
    membership.published_leave = 9  # a member is lost: the exchange is abandoned...
    thread.join(5.0)
    assert isinstance(outcome[0], MembershipChanged), outcome
    works[5].ends.set()  # ...what was asked for comes all the same, and is kept...
    works[1].ends.set()
    assert settled(8) == [0, 1, 2, 3, 4, 5, 6]  # ...and nothing more is asked for
    assert received == [True, True, True, True, False, True, False, False, False]
    for work in works:
        work.ends.set()
    monkeypatch.setattr(waits, "WINDOW_S", 60.0)  # a fast link: its rate opens the window wide
    works[:] = [_Transfer() for _ in range(9)]
    posted.clear()
    membership.published_leave = 8
    received[:] = [False] * 9  # (the list the exchange above was given)
    outcome.clear()
    thread = threading.Thread(target=lambda: outcome.append(_run(exchange, 5.0)))
    thread.start()
    assert settled(4) == [0, 1, 2, 4]
    works[0].ends.set()  # peer 1's first arrival starts the rate's clock...
    works[2].ends.set()  # ...its second gives the rate: a minute of it is all of peer 1's left
    assert settled(8) == [0, 1, 2, 3, 4, 5, 6, 8]  # (peer 3's: two, none arrived)
    for work in works:
        work.ends.set()
    thread.join(5.0)
    assert outcome == [None] and all(received)


def test_deferred_sends_go_a_window_of_copies_at_a_time_and_free_the_state_once_abandoned(monkeypatch):
    """A member's sends of a deferred hand-over whose joiner asks for no more (a member lost):
    those pending on the retired group used to be slices of the whole encoded state, held until
    that group's timeout (hours on a slow link), one state per cut admission. Now at most two
    per peer are posted, each a copy of its chunk; a copy sent is let go, and the rest of the
    state is dropped at the cut."""
    import gc
    import weakref

    from geotrain.comm import waits

    monkeypatch.setattr(waits, "WINDOW_S", 0.0)
    membership = types.SimpleNamespace(epoch=8, published_leave=8)
    copies: list = []  # weak: a send's work holds its tensor, as gloo's does
    ends = [threading.Event() for _ in range(8)]
    comm = _exchanging_comm(monkeypatch, membership, [])

    views: list[bool] = []

    def isend(tensor, *args, **kwargs):
        views.append(tensor._base is not None)  # a copy, not a view of the state
        work = _Transfer()  # held by the sender alone
        work.ends, work.tensor = ends[len(copies)], tensor
        copies.append(weakref.ref(tensor))
        return work

    monkeypatch.setattr(dist, "isend", isend)
    state = torch.arange(8 * 1024, dtype=torch.int64).to(torch.uint8)
    alive = weakref.ref(state)
    chunks = [(state[i * 1024 : (i + 1) * 1024], 3, i) for i in range(8)]
    posted = comm.send_later(chunks)
    del state, chunks

    def settled(n: int) -> int:
        deadline = time.monotonic() + 2.0
        while len(copies) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # and no more than that
        return len(copies)

    assert settled(2) == 2 and views == [False, False]
    ends[0].set()  # sent: the next is posted, and the work (with its copy) let go
    assert settled(3) == 3
    membership.published_leave = 9  # a member is lost
    assert isinstance(_run(posted.finish, 5.0), MembershipChanged)
    assert posted.finished.wait(5.0)  # the thread gave up: nothing more posted, the rest dropped
    gc.collect()
    assert alive() is None
    assert copies[0]() is None and copies[1]() is not None  # the one sent freed, pending ones held
    ends[1].set()  # what was posted goes on: sent, and let go; nothing more is posted
    ends[2].set()
    assert settled(4) == 3
    gc.collect()
    assert copies[1]() is None and copies[2]() is None
    for end in ends:
        end.set()


def test_an_exchange_that_stops_posting_for_a_lost_member_fails_though_what_it_posted_arrived(monkeypatch):
    """A lane that sees the lost member first stops posting; the transfers it had posted
    complete, and the exchange must still fail: the rest was never sent (it once returned as if
    the whole hand-over had gone, and the member went on from a state the joiner lacks)."""
    from geotrain.comm import waits

    monkeypatch.setattr(waits, "INTERRUPT_POLL", timedelta(seconds=60))  # only a lane can see it
    membership = types.SimpleNamespace(epoch=8, published_leave=8)
    works = [_Transfer(0.0) for _ in range(5)]
    comm = _exchanging_comm(monkeypatch, membership, works)
    waited = []

    def wait(work, timeout):  # the member is lost as the first transfer completes
        waited.append(work)
        membership.published_leave = 9
        work.wait()

    monkeypatch.setattr(waits, "plain_wait", wait)
    outcome = _run(lambda: comm.exchange([(torch.zeros(4), 3, i) for i in range(5)], []), 5.0)
    assert isinstance(outcome, MembershipChanged), outcome
    assert waited == works[:2]  # the two posted first, waited on; none posted after the loss


def test_a_receive_whose_posting_fails_is_told_in_its_turn_after_those_before_it():
    """A receive that cannot be posted (its connection closed) ends its lane where it is waited
    on: the one before it, which had arrived, is waited on and flagged first, so a retry keeps it."""
    from geotrain.comm.waits import Unposted, wait_transfers

    first, second = _Transfer(0.05), _Transfer(0.05)

    def closed():
        raise RuntimeError("Connection closed by peer")

    works = [Unposted(lambda: first, 4), Unposted(lambda: second, 4), Unposted(closed, 4)]
    flags = [False] * 3
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_transfers(works, lambda: False, None, [7, 7, 7], lambda i: flags.__setitem__(i, True))
    assert flags == [True, True, False]


def test_members_regroup_at_once_when_the_joiner_they_hand_over_to_loses_a_server(tmp_path, monkeypatch):
    """The soak's events on a real store: epoch 2 admits joiner 2 and hosts 0, 1, 3 send it their
    state; host 3 is killed mid-stripe (epoch 3: 0, 1, 2). Hosts 0 and 1 finished sending and wait
    for epoch 3's members to be ready; the joiner, alive, must leave the transfer and be ready too
    (it stayed in it, and everyone waited until the next kill)."""
    store = _master()
    epochs = Epochs(store, tmp_path, 4)
    epochs.leave({2}, "exited")
    epochs.join(2)  # epoch 2 = [0, 1, 3, 2]: formed; the hand-over is under way
    ms = {h: Membership("127.0.0.1", store.port, h, [0, 1, 3, 2], timeout_s=3.0) for h in (0, 1, 2)}
    for m in ms.values():
        m.epoch = m.published = m.published_leave = 2
    stuck = _Transfer()  # the joiner's receive from host 3
    comm = _exchanging_comm(monkeypatch, ms[2], [_Transfer(0.05), stuck, _Transfer(0.05)])
    stop = threading.Event()
    formed: dict[int, object] = {}

    def heartbeats():  # each trainer's heartbeat thread, one client for all
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        while not stop.is_set():
            for m in ms.values():
                m.observe(client, int(client.add("epoch", 0)))
            time.sleep(0.05)

    def joiner():
        with contextlib.suppress(MembershipChanged):
            comm.exchange([], [(torch.zeros(4), r, 0) for r in (0, 2, 1)])  # from hosts 0, 3, 1
        formed[2] = ms[2].next_epoch()

    def member(h):
        formed[h] = ms[h].next_epoch()  # it finished sending; its next step saw epoch 3

    def record(h, fn):
        try:
            fn()
        except Exception as e:
            formed[h] = e

    threads = [threading.Thread(target=heartbeats, daemon=True)]
    threads += [threading.Thread(target=record, args=(2, joiner), daemon=True)]
    threads += [threading.Thread(target=record, args=(h, lambda h=h: member(h)), daemon=True) for h in (0, 1)]
    threading.Timer(0.3, epochs.leave, args=({3}, "exited")).start()  # host 3 killed mid-stripe
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(5.0)
    finally:
        stuck.ends.set()
        stop.set()
        threads[0].join()
    assert formed == {h: (3, [0, 1, 2]) for h in (0, 1, 2)}, formed
    assert time.monotonic() - t0 < 3.0


def _master():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_epochs_are_published_and_a_restarted_coordinator_publishes_them_again(tmp_path):
    store = _master()
    epochs = Epochs(store, tmp_path, 4)
    assert store.add("epoch", 0) == 0 and store.get("members/0") == b"0,1,2,3"
    epochs.leave({0}, "exited")
    epochs.leave({0}, "silent")  # already gone: no new epoch
    epochs.leave({2}, "silent")
    assert store.add("epoch", 0) == 2 and store.get("members/2") == b"1,3"
    assert [(e["epoch"], e["left"], e["why"]) for e in read_epochs(tmp_path)] == [
        (1, [0], "exited"),
        (2, [2], "silent"),
    ]
    fresh = _master()  # the restarted coordinator's empty store
    again = Epochs(fresh, tmp_path, 4)
    assert (again.epoch, again.live) == (2, [1, 3])
    assert fresh.add("epoch", 0) == 2 and fresh.get("members/1") == b"1,2,3"


def test_a_member_waits_for_the_others_and_a_host_declared_failed_is_told_so(tmp_path):
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "silent")
    host0 = Membership("127.0.0.1", store.port, 0, [0, 1, 2], timeout_s=1.0)
    with pytest.raises(TimeoutError, match="did not all get ready"):
        host0.next_epoch()  # host 1 never says it is ready
    store.set("ready/1/1", "1")
    assert host0.next_epoch() == (1, [0, 1])
    with pytest.raises(Excluded, match="host 2 is not in epoch 1"):
        Membership("127.0.0.1", store.port, 2, [0, 1, 2], timeout_s=1.0).next_epoch()


def test_a_joiner_gets_an_epoch_of_its_own_last_in_rank_order_and_a_lost_host_can_come_back(tmp_path):
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({0}, "exited")
    epochs.join(0)
    epochs.join(0)  # already in: no new epoch
    assert store.add("epoch", 0) == 2 and store.get("members/2") == b"1,2,0"
    assert (store.get("kind/1"), store.get("kind/2")) == (b"leave", b"join")
    assert [(e["epoch"], e.get("left"), e.get("joined")) for e in read_epochs(tmp_path)] == [
        (1, [0], None),
        (2, None, [0]),
    ]
    store.set("ready/2/0", "1")  # the joiner waits, ready, for the members' boundary
    epochs.leave({0}, "exited")  # and is killed there: its mark must not complete epoch 2
    assert not store.check(["ready/2/0"])
    fresh = _master()
    Epochs(fresh, tmp_path, 3)  # a restarted coordinator: the kinds come back too
    assert (fresh.get("kind/1"), fresh.get("kind/2"), fresh.get("members/2")) == (b"leave", b"join", b"1,2,0")


def test_members_admit_a_joiner_at_the_same_sync_boundary_the_furthest_any_has_committed_to(tmp_path):
    """H=4. Host 0 starts step 9 (it has just finished the boundary at 8) when the join epoch
    appears; host 1 is inside step 10 (its heartbeat posts the boundary it is heading for, 12).
    Both finish the period and regroup before step 13; a join interrupts no collective."""
    store = _master()
    Epochs(store, tmp_path, 2).join(2)  # host 2 had never been in: a joiner like any other
    m0, m1 = (Membership("127.0.0.1", store.port, h, [0, 1], timeout_s=2.0, period=4) for h in (0, 1))
    assert not m0.admit_before(8) and not m1.admit_before(10)  # before they learn of it
    m1.observe(store, store.add("epoch", 0))  # host 1's heartbeat thread, during step 10
    assert store.get("at/0/1") == b"12" and not m1.changed() and m1.joining()
    m0.observe(store, 1)
    assert not m0.admit_before(9)  # it proposes 8, and learns the others' proposals
    assert store.get("at/0/0") == b"8"
    assert [m0.admit_before(t) for t in (10, 11, 12, 13)] == [False, False, False, True]
    assert [m1.admit_before(t) for t in (11, 12, 13)] == [False, False, True]


def test_a_member_redoing_an_average_after_a_regroup_still_posts_its_boundary(tmp_path):
    """After a regroup the member redoes its failed average (H=4, step 8) before any step starts;
    a join epoch published meanwhile must get its proposal from the heartbeat thread."""
    store = _master()
    Epochs(store, tmp_path, 2).join(2)
    m0 = Membership("127.0.0.1", store.port, 0, [0, 1], timeout_s=2.0, period=4)
    m0.observe(store, 0)
    assert not m0.joining()
    m0.going_on_after(8)  # as regroup says, for StepStatus(7, True)
    m0.observe(store, store.add("epoch", 0))  # the heartbeat thread, during the redone average
    assert store.get("at/0/0") == b"8"


def test_an_epoch_all_members_were_ready_for_is_taken_even_when_a_newer_one_appears(tmp_path):
    """Host 0 is ready for epoch 1 and waits for host 1; a joiner's epoch 2 appears; then host 1
    says it is ready for epoch 1 and forms it. Host 0 must form epoch 1 too, not wait in 2."""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    host0 = Membership("127.0.0.1", store.port, 0, [0, 1, 2], timeout_s=5.0)

    def later():
        epochs.join(2)
        time.sleep(0.3)
        store.set("ready/1/1", "1")

    timer = threading.Timer(0.3, later)
    timer.start()
    assert host0.next_epoch() == (1, [0, 1])
    timer.join()


def test_a_member_that_waits_to_admit_a_joiner_regroups_for_a_lost_member_instead(tmp_path):
    store = _master()
    epochs = Epochs(store, tmp_path, 2)
    epochs.join(2)
    m0 = Membership("127.0.0.1", store.port, 0, [0, 1], timeout_s=5.0, period=1)
    m0.observe(store, 1)
    timer = threading.Timer(0.3, epochs.leave, args=({1}, "silent"))  # host 1 never proposes
    timer.start()
    with pytest.raises(MembershipChanged):
        m0.admit_before(5)  # it waits for host 1's proposal until host 1 is declared lost
    timer.join()
    assert m0.changed()


# -- real gloo processes ----------------------------------------------------------------------


def _hosts(fn, store, n: int, kept: tuple[int, ...]) -> list[dict]:
    """``fn(host, store port, file store, out)`` on ``n`` spawned hosts; the results of ``kept``
    (each host saved {"ok": ...} or {"error": traceback})."""
    ctx = CONTEXT  # forked from a server that imported torch once
    with tempfile.TemporaryDirectory(prefix="geotrain-test-") as tmp:
        outs = [os.path.join(tmp, f"host{h}.pt") for h in range(n)]
        procs = [
            ctx.Process(target=fn, args=(h, store.port, os.path.join(tmp, "fs"), outs[h]), daemon=True)
            for h in range(n)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        for p in procs:
            if p.is_alive():
                p.kill()
        got = [torch.load(outs[h], weights_only=False) for h in kept]
    for g in got:
        assert "ok" in g, g.get("error")
    return [g["ok"] for g in got]


def _survivor(host: int, store_port: int, file_store: str, out: str) -> None:
    from geotrain.comm.communicator import Communicator
    from geotrain.ft.elastic import regroup
    from geotrain.sync import build_sync
    from geotrain.sync.noise import NoiseScale

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{file_store}", rank=host, world_size=3)
        membership = Membership("127.0.0.1", store_port, host, [0, 1, 2], timeout_s=30)
        rounds = []
        for algo in (
            "ssgd",
            "localsgd",
            "drift",
            "meet",
            "meet-auto",
            "ddp",
        ):  # the first epoch's 3 build them
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
            comm = Communicator(membership=membership)
            method = "localsgd" if algo in ("drift", "meet", "meet-auto") else algo
            sync = build_sync(method, model, optimizer, comm, {"H": 4})
            if algo == "meet-auto":  # --lr-scale auto: each holds its sample for the failed sync
                sync.noise = NoiseScale(sync.parameters(), optimizer, samples=16)
                sync.noise.pending = torch.full((16,), float(host + 1))
            rounds.append((algo, model, optimizer, sync))
        if host == 2:
            os._exit(0)  # lost
        results = {}
        for algo, model, optimizer, sync in rounds:
            comm = sync.comm
            status = {
                "ssgd": StepStatus(5 - host, False),
                "localsgd": StepStatus(3, True),
                "drift": StepStatus(5 + host, False),
                "meet": StepStatus(3, host == 0),  # host 1 had not applied step 4 yet
                "meet-auto": StepStatus(3, host == 0),
            }.get(algo, StepStatus(2, False))
            with torch.no_grad():  # replicas that differ, as after a failure
                for p in model.parameters():
                    p.add_(host + 1)
            model(torch.ones(3, 8)).sum().backward()
            optimizer.step()
            sync.step_count = 4 if algo == "localsgd" or status.local_done else status.committed
            before = [p.detach().clone() for p in model.parameters()]
            event = regroup(membership, comm, sync, model, optimizer, status)
            if algo.startswith("meet") and not status.local_done:
                sync.after_step()  # its step 4 done: its average meets host 0's redone one
            results[algo] = {
                "event": event,
                "before": before,
                "after": [p.detach().clone() for p in model.parameters()],
                "step_count": sync.step_count,
                "optimizer": optimizer.state_dict()["state"][0]["exp_avg"].clone(),
                "noise": sync.noise.state_dict() if sync.noise is not None else None,
            }
            if algo == "ddp":  # the new wrapper averages over the new group
                optimizer.zero_grad()
                sync.model(torch.full((3, 8), float(host))).sum().backward()
                results[algo]["grads"] = [p.grad.clone() for p in model.parameters()]
            sync.close()
            dist.barrier()
            if host == 0 and algo != "ddp":  # the next round needs an epoch of its own
                membership.store().set(f"members/{membership.epoch + 1}", "0,1")
                membership.store().add("epoch", 1)
        dist.destroy_process_group()
        torch.save({"ok": results}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def test_survivors_regroup_the_one_behind_adopts_the_leader_and_a_failed_average_is_redone(tmp_path):
    """Host 2 leaves. ssgd: host 0 finished step 5, host 1 only step 4 (its collective failed
    where host 0's had finished): host 1 adopts host 0's model, optimizer and step, bitwise.
    localsgd: both applied step 4 locally and their average failed: it is redone over the two,
    giving exactly their mean. localsgd between syncs (H=4), host 0 at step 5 and host 1 at 6:
    nothing moves, each goes on from its own step. localsgd, host 0's average after step 4 failed
    and host 1 had not finished step 4: host 0 redoes it in the regroup, host 1 meets it from its
    own after_step, and both hold their mean (and so with --lr-scale auto, both exchanging their
    noise samples first). ddp: a new wrapper on the new group averages the two
    gradients."""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    (h0, h1) = _hosts(_survivor, store, 3, (0, 1))

    e0, e1 = h0["ssgd"]["event"], h1["ssgd"]["event"]
    assert (
        e0["members"] == [0, 1] and e0["leader"] == 0 and e0["behind"] == [1] and e0["handed_over_bytes"] > 0
    )
    assert e1["resume"] == StepStatus(5, False)
    for a, b, mine in zip(h0["ssgd"]["after"], h1["ssgd"]["after"], h0["ssgd"]["before"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, mine)
    assert torch.equal(h0["ssgd"]["optimizer"], h1["ssgd"]["optimizer"])
    assert h0["ssgd"]["step_count"] == h1["ssgd"]["step_count"] == 5

    l0, l1 = h0["localsgd"], h1["localsgd"]
    assert l0["event"]["epoch"] == 2 and l0["event"]["behind"] == [] and l0["event"]["handed_over_bytes"] == 0
    for a, b, x0, x1 in zip(l0["after"], l1["after"], l0["before"], l1["before"], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, (x0 + x1) / 2, rtol=0, atol=1e-6)
    assert not torch.equal(l0["before"][0], l1["before"][0])

    for h, r in enumerate((h0["drift"], h1["drift"])):
        event = r["event"]
        assert event["epoch"] == 3 and event["behind"] == [] and event["handed_over_bytes"] == 0
        assert r["event"]["resume"] == StepStatus(5 + h, False) and r["step_count"] == 5 + h
        assert r["event"]["furthest"] == 6
        assert all(torch.equal(a, b) for a, b in zip(r["after"], r["before"], strict=True))
    assert not torch.equal(h0["drift"]["after"][0], h1["drift"]["after"][0])

    for case in ("meet", "meet-auto"):
        m0, m1 = h0[case], h1[case]
        assert m0["event"]["behind"] == [] and m0["event"]["resume"] == StepStatus(3, True)
        assert m1["event"]["resume"] == StepStatus(3, False) and m0["step_count"] == m1["step_count"] == 4
        for a, b, x0, x1 in zip(m0["after"], m1["after"], m0["before"], m1["before"], strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, (x0 + x1) / 2, rtol=0, atol=1e-6)
    # --lr-scale auto: the redone sync and the one met from a member's own step exchange the
    # noise sample alike (one measure from both samples), so their collectives match.
    n0, n1 = h0["meet-auto"]["noise"], h1["meet-auto"]["noise"]
    assert n0 == n1 and n0["measures"] == 1 and n0["noise"] > 0

    d0, d1 = h0["ddp"], h1["ddp"]
    assert d0["event"]["epoch"] == 6 and d0["event"]["members"] == [0, 1]
    for g0, g1 in zip(d0["grads"], d1["grads"], strict=True):
        assert torch.equal(g0, g1)


def _shifted_replica(host: int, membership: Membership, algo: str):
    """A two-layer model (seed 0) with AdamW, a communicator and ``algo``'s sync (H=4), its
    parameters shifted by ``host + 1``: replicas that differ, as after local steps. ``checked``:
    local SGD with the norm check on; DiLoCo at outer lr 1 without momentum (the plain mean)."""
    from geotrain.comm.communicator import Communicator
    from geotrain.sync import build_sync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    comm = Communicator(membership=membership, max_norm_ratio=10 if algo == "checked" else 0)
    options = {"H": 4} | {
        "diloco": {"outer_lr": 1.0, "outer_momentum": 0.0},
        "sparseloco": {"chunk": 16, "k": 16, "overlap": False},
        "overlapped": {"chunk": 16, "k": 16, "overlap": True},  # landing at the next outer step
    }.get(algo, {})
    name = {"checked": "localsgd", "overlapped": "sparseloco"}.get(algo, algo)
    sync = build_sync(name, model, optimizer, comm, options)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(host + 1)
    return model, optimizer, comm, sync


def _saved(fn):
    """A gloo test host: ``fn(host, store port, file store, *args)`` returns its result, which
    is saved to ``out`` with the group left (or its traceback, and the error raised)."""

    @functools.wraps(fn)
    def host(h: int, store_port: int, file_store: str, out: str, *args, **kwargs) -> None:
        try:
            result = fn(h, store_port, file_store, *args, **kwargs)
            dist.destroy_process_group()
            torch.save({"ok": result}, out)
        except BaseException:
            torch.save({"error": traceback.format_exc()}, out)
            raise

    return host


def _heartbeat(membership: Membership, store_port: int) -> None:
    """What a trainer's heartbeat thread does: it learns of new epochs, so that a collective
    waiting on a lost member gives up."""
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)

    def beat() -> None:
        while True:
            membership.observe(client, int(client.add("epoch", 0)))
            time.sleep(0.1)

    threading.Thread(target=beat, daemon=True).start()


def _admit_after_redo(event, membership, comm, sync, model, optimizer) -> dict:
    """What train() does once this worker has completed a sync redone with joiners standing in:
    the joiners receive the state (the members' sends waited on here, not at their next sync)."""
    from geotrain.ft.elastic import admit_after_redo

    if not event["hand_over_after"]:
        return {}
    joiners = [event["members"].index(h) for h in event["deferred"]]
    handed = admit_after_redo(
        membership, comm, sync, model, optimizer, event["hand_over_after"], joiners, event["from_state"]
    )
    if membership.sending is not None:
        membership.sending.finish()
        membership.sending = None
    return handed


def _redoer(
    host: int, store_port: int, file_store: str, out: str, late: bool = False, steps: int = 40
) -> None:
    """Host 2 is a joiner; hosts 0 and 1 applied step 4 and their average (H=4) failed. ``late``:
    host 1 was at step 2 instead, short of that sync, and meets the redo from its own step.
    ``steps``: the run's last step (6: the next sync, 8, is past it, and the joiner takes the
    state before the redo; 40: it stands in for the redo and takes the state after it)."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{file_store}", rank=host, world_size=3)
        membership = Membership("127.0.0.1", store_port, host, [0, 1, 2], timeout_s=30)
        results = {}
        algos = ("localsgd", "sparseloco", "overlapped") if late else ("localsgd", "diloco", "checked")
        for algo in algos if steps == 40 else algos[:2]:
            model, optimizer, comm, sync = _shifted_replica(host, membership, algo)
            role = "joiner" if host == 2 else "short" if late and host == 1 else "redo"
            sync.step_count, status = {  # its step, and its status in the regroup
                "joiner": (0, StepStatus(-1, False)),
                "short": (2, StepStatus(2, False)),
                "redo": (4, StepStatus(3, True)),
            }[role]
            before = [p.detach().clone() for p in model.parameters()]
            event = regroup(membership, sync.comm, sync, model, optimizer, status, steps=steps)
            if role == "short":  # its steps 3 and 4 (no local change), as train() takes them
                left_out = frozenset(event["members"].index(h) for h in event["left_out"])
                assert event["left_out_until"] == 4
                sync.after_step()
                with comm.leaving_out(left_out):
                    sync.after_step()
            handed = _admit_after_redo(event, membership, comm, sync, model, optimizer)
            anchor = None
            if algo == "overlapped":  # step 4's gather, launched in the redo, lands at 8 (the
                joiners = frozenset(event["members"].index(h) for h in event["deferred"])  # meeting)
                for n in range(5, 9):
                    with (
                        comm.leaving_out(joiners)
                        if n == event["deferred_until"]
                        else contextlib.nullcontext()
                    ):
                        sync.after_step()
                anchor = tensors_digest(sync.shared_state())
            results[algo] = {
                "event": event,
                "handed": handed,
                "anchor": anchor,
                "step_count": sync.step_count,
                "before": before,
                "after": [p.detach().clone() for p in model.parameters()],
                "rejected": comm.rejected_by_rank,
            }
            sync.close()
            dist.barrier()
            if host == 0:
                membership.store().set(f"members/{membership.epoch + 1}", "0,1,2")
                membership.store().add("epoch", 1)
        dist.destroy_process_group()
        torch.save({"ok": results}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def _late_meeter(host: int, store_port: int, file_store: str, out: str) -> None:
    _redoer(host, store_port, file_store, out, late=True)


def _late_meeter_at_the_end(host: int, store_port: int, file_store: str, out: str) -> None:
    _redoer(host, store_port, file_store, out, late=True, steps=6)


def test_an_average_redone_with_a_joiner_counts_the_leader_once(tmp_path):
    """A member is lost at a sync boundary while a joiner waits: the survivors (hosts 0 and 1)
    had applied step 4 and their average failed. The joiner (host 2) takes no state before the
    redo (a model's worth on the slow link, which held every member): it stands in for its part
    of the redone average, left out, and receives the survivors' state after it. All three must
    hold the survivors' mean, not (2 x0 + x1) / 3 nor anything of the joiner's own."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")  # the new epoch: the survivors and the joiner
    store.add("epoch", 1)
    runs = _hosts(_redoer, store, 3, (0, 1, 2))
    # localsgd, diloco at outer lr 1 without momentum (the same mean), localsgd with the norm
    # check on (the stand-in left out of the verdict, not counted as rejected)
    for algo in ("localsgd", "diloco", "checked"):
        ranks = [r[algo] for r in runs]
        for r in ranks:
            event = r["event"]
            assert event["behind"] == [] and event["deferred"] == [2], event
            assert event["hand_over_after"] == 4 and event["deferred_until"] == 8 and r["step_count"] == 4
            assert r["handed"]["handed_over_bytes"] > 0 and r["handed"]["stripes"]["model"] == 2
        assert ranks[2]["event"]["resume"] == StepStatus(4, False)
        for k, x0 in enumerate(ranks[0]["before"]):
            mean = (x0 + ranks[1]["before"][k]) / 2
            for r in ranks:
                torch.testing.assert_close(r["after"][k], mean, rtol=0, atol=1e-6)
        assert all(r["rejected"] == {} for r in ranks)


@pytest.mark.parametrize("steps", [40, 6])
def test_a_member_short_of_a_sync_redone_with_a_joiner_meets_it_from_its_own_step(tmp_path, steps):
    """A member is lost at a sync boundary while a joiner waits: host 0 applied step 4 and its
    average failed, host 1 was at step 2. Host 1 keeps its own state, and meets the redone
    average from its step 4 with the joiner's part left out. The joiner stands in for the redo
    and receives the state once host 1 has met it (``steps`` 40); or, where the members' next
    sync is past the run's end (``steps`` 6), it adopts host 0's state before the redo. All
    three end with the mean of hosts 0 and 1: the code before made host 1 adopt host 0's state
    too, and the average was host 0's alone."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")  # the new epoch: the survivors and the joiner
    store.add("epoch", 1)
    runs = _hosts(_late_meeter if steps == 40 else _late_meeter_at_the_end, store, 3, (0, 1, 2))
    if steps == 40:  # overlapped: the joiner lands the gather it stood in for, as the members do
        anchors = [r["overlapped"]["anchor"] for r in runs]
        assert anchors[0] is not None and anchors == [anchors[0]] * 3
    for algo in ("localsgd", "sparseloco"):
        ranks = [r[algo] for r in runs]
        for r in ranks:
            assert r["event"]["left_out"] == [2] and r["step_count"] == 4, r["event"]
            if steps == 40:
                assert r["event"]["behind"] == [] and r["event"]["hand_over_after"] == 4, r["event"]
                assert r["handed"]["handed_over_bytes"] > 0
            else:
                assert r["event"]["behind"] == [2] and not r["event"]["hand_over_after"], r["event"]
                assert r["event"]["handed_over_bytes"] > 0  # (the joiner's, the same for all)
        for k in range(len(ranks[0]["after"])):
            assert torch.equal(ranks[0]["after"][k], ranks[1]["after"][k])
            assert torch.equal(ranks[0]["after"][k], ranks[2]["after"][k])
        if algo == "localsgd":
            for k, x0 in enumerate(ranks[0]["before"]):
                mean = (x0 + ranks[1]["before"][k]) / 2
                torch.testing.assert_close(ranks[0]["after"][k], mean, rtol=0, atol=1e-6)


@_saved
def _revived(host: int, store_port: int, file_store: str, meeting: bool = False) -> dict:
    """Local SGD (H=4). Host 0, the only member, after step 5; host 1 joins (epoch 1), deferred to
    step 8, loads host 0's state and skips step 6; then host 0 is lost, and host 2 joins (epoch 2:
    hosts 1 and 2, no member left). ``meeting``: host 1 skips step 7 too and waits in step 8's
    sync (the meeting) when host 0 is lost: that sync failed on it."""
    from geotrain.ft.elastic import regroup

    torch.set_num_threads(1)
    membership = Membership("127.0.0.1", store_port, host, [0] if host == 0 else [], timeout_s=30)
    model, optimizer, comm, sync = _shifted_replica(host, membership, "localsgd")
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    result = {}
    if host == 0:
        sync.step_count = 5
        result["first"] = regroup(membership, comm, sync, model, optimizer, StepStatus(5, False), steps=40)
        membership.sending.finish()  # (the joiner has it all before this host is lost)
        if meeting:  # lost once host 1 waits in the meeting
            client.wait(["meeting"], timedelta(seconds=30))
            time.sleep(0.5)
        client.set("kind/2", "leave")
        client.set("members/2", "1,2")
        client.add("epoch", 1)
    elif host == 1:
        result["first"] = regroup(membership, comm, sync, model, optimizer, StepStatus(-1, False), steps=40)
        held = StepStatus(6, False)
        sync.after_step()  # step 6, skipped (a deferred joiner computes nothing up to step 8)
        if meeting:
            _heartbeat(membership, store_port)  # the sync gives up
            sync.after_step()  # step 7
            client.set("meeting", "1")
            with pytest.raises(RuntimeError), comm.leaving_out({1}):
                sync.after_step()  # step 8: host 0 is lost while it waits
            held = StepStatus(7, True)
        result["second"] = regroup(
            membership, comm, sync, model, optimizer, StepStatus(-1, False), steps=40, held=held
        )
    else:
        result["second"] = regroup(membership, comm, sync, model, optimizer, StepStatus(-1, False), steps=40)
    if "second" in result:
        result["handed"] = _admit_after_redo(result["second"], membership, comm, sync, model, optimizer)
    if host == 1 and membership.sending is not None:
        membership.sending.finish()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    result["step_count"] = sync.step_count
    sync.close()
    return result


def _revived_in_the_meeting(host: int, store_port: int, file_store: str, out: str) -> None:
    _revived(host, store_port, file_store, out, meeting=True)


@pytest.mark.parametrize("meeting", [False, True])
def test_a_deferred_joiner_holding_the_state_goes_on_when_no_member_is_left(tmp_path, meeting):
    """The only member is lost after a joiner, admitted deferred, loaded its state and before
    it met the members; a second joiner comes. The first goes on from the state it holds (its
    step 6) and is the second's leader, which receives its state deferred: where both used to
    exit (``NoStateHolder``) and every host restarted from the snapshots. ``meeting``: the
    member is lost while the first waits in the meeting sync (step 8), the usual place (a
    joiner skipping its steps runs ahead): it redoes that sync alone, the second standing in,
    and the second receives the state after it."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1")  # host 1 joins host 0
    store.add("epoch", 1)
    h0, h1, h2 = _hosts(_revived_in_the_meeting if meeting else _revived, store, 3, (0, 1, 2))
    assert h0["first"]["deferred"] == [1] and h0["first"]["deferred_until"] == 8
    second = h1["second"]
    assert second["members"] == [1, 2] and second["leader"] == 1 and second["deferred"] == [2], second
    if meeting:
        assert second["resume"] == StepStatus(7, True) and second["hand_over_after"] == 8, second
        assert h2["handed"]["handed_over_bytes"] > 0 and h2["step_count"] == h1["step_count"] == 8
    else:
        assert second["resume"] == StepStatus(6, False) and not second["hand_over_after"], second
        assert h2["second"]["handed_over_bytes"] > 0 and h2["step_count"] == h1["step_count"] == 6
    for a, b, c in zip(h0["params"], h1["params"], h2["params"], strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)  # host 0's at step 5, handed on twice


def _late_meeter_refault(host: int, store_port: int, file_store: str, out: str, steps: int = 6) -> None:
    """As ``_redoer(late=True)`` with a fourth host, short of the sync as host 1 is, lost once the
    joiner has adopted and while the redo waits for host 1: a second regroup, whose redo still
    holds the joiner's copy (it has no joiner left to make ``left_out`` of). With ``steps`` 40
    the joiner stands in instead, twice, and receives the state after the second redo."""
    from geotrain.ft.elastic import regroup

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{file_store}", rank=host, world_size=4)
        membership = Membership("127.0.0.1", store_port, host, [0, 1, 2, 3], timeout_s=30)
        model, optimizer, comm, sync = _shifted_replica(host, membership, "localsgd")
        sync.step_count = {0: 4, 1: 2, 2: 0, 3: 2}[host]
        status = {0: StepStatus(3, True), 2: StepStatus(-1, False)}.get(host, StepStatus(2, False))

        _heartbeat(membership, store_port)  # the redo gives up
        before = [p.detach().clone() for p in model.parameters()]
        adopted = []
        first = second = None
        try:
            first = regroup(
                membership, comm, sync, model, optimizer, status, steps=steps,
                adopted=lambda s, t: adopted.append(s),
            )  # fmt: skip
        except RuntimeError:  # the redo, cut by host 3's loss
            assert host in (0, 2)
        if host == 3:
            os._exit(0)  # lost after the hand-over, before the redo completes
        if host == 1:  # it notices the loss before its step 3 (its heartbeat), and says so
            time.sleep(1.0)
            client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
            client.set("members/2", "0,1,2")
            client.add("epoch", 1)
        status = adopted[-1] if adopted else status  # the joiner is at the leader's status now
        second = regroup(membership, comm, sync, model, optimizer, status, steps=steps)
        if host == 1:
            left_out = frozenset(second["members"].index(h) for h in second["left_out"])
            sync.after_step()
            with comm.leaving_out(left_out):
                sync.after_step()
        handed = _admit_after_redo(second, membership, comm, sync, model, optimizer)
        result = {
            "first": first,
            "second": second,
            "handed": handed,
            "before": before,
            "after": [p.detach().clone() for p in model.parameters()],
        }
        sync.close()
        dist.destroy_process_group()
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def _stand_in_refault(host: int, store_port: int, file_store: str, out: str) -> None:
    _late_meeter_refault(host, store_port, file_store, out, steps=40)


@pytest.mark.parametrize("stands_in", [False, True])
def test_a_late_member_meets_a_redo_that_failed_again_leaving_out_the_copy_still_held(tmp_path, stands_in):
    """The joiner adopted host 0's state and both redo the average; host 3 (short of the sync,
    as host 1 is) is lost before host 1 meets it. In the second regroup no joiner is left, but
    the joiner still holds host 0's copy, which the redo leaves out: host 1 must leave it out
    too (``left_out``), or it divides by three where the others divide by two. Where the joiner
    stands in for the redo instead (the members' next sync is before the run's end), it is a
    joiner still in the second regroup: it stands in again, and receives the state after it."""
    store = _master()
    Epochs(store, tmp_path, 4)
    store.set("members/1", "0,1,2,3")
    store.add("epoch", 1)
    h0, h1, h2 = _hosts(_stand_in_refault if stands_in else _late_meeter_refault, store, 4, (0, 1, 2))
    if stands_in:
        for event in (h1["first"], h1["second"]):
            assert event["behind"] == [] and event["left_out"] == [2] and event["deferred"] == [2], event
        assert h1["second"]["hand_over_after"] == 4 and h2["handed"]["handed_over_bytes"] > 0
    else:
        assert h1["first"]["behind"] == [2] and h1["first"]["left_out"] == [2]
        assert h1["second"]["behind"] == [] and h1["second"]["left_out"] == [2], h1["second"]
    for k, x0 in enumerate(h0["before"]):
        mean = (x0 + h1["before"][k]) / 2
        for h in (h0, h1, h2):
            torch.testing.assert_close(h["after"][k], mean, rtol=0, atol=1e-6)


def test_a_broker_ends_with_the_run_and_a_restarted_one_remembers_who_left_and_how(tmp_path):
    """``serve(until_done=True)`` (``geotrain broker``): a trainer that fails says so and its host
    leaves at once (no fault timeout); the broker returns once every member has left, saying
    whether the run finished. One restarted on the same port (``--restart``) knows from its files
    that host 0 left in order and that the run had finished."""
    import socket

    from geotrain.launch.coordinator import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "attempt").write_text("0")
    out: list = []

    def broker(restarted: bool = False) -> None:
        out.append(
            serve(tmp_path, 2, 30.0, "127.0.0.1", port, elastic=True, until_done=True, restarted=restarted)
        )

    t = threading.Thread(target=broker, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not (tmp_path / "port").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    for h in (0, 1):
        client.add(f"hb/0/{h}", 1)
    time.sleep(0.5)
    client.set("failed/0/1", "1")
    while not read_epochs(tmp_path):
        assert time.monotonic() < deadline, "host 1 did not leave"
        time.sleep(0.05)
    assert [(e["members"], e["why"]) for e in read_epochs(tmp_path)] == [([0], "exited")]
    client.set("finished", "1")
    client.set("bye/0/0", "1")
    t.join(timeout=10)
    assert out == [{"finished": True, "stopped": False}]
    assert (tmp_path / "finished").exists() and (tmp_path / "bye-0-0").exists()
    del client
    t = threading.Thread(target=broker, args=(True,), daemon=True)  # --restart: the same files and port
    t.start()
    t.join(timeout=20)
    assert out[1] == {"finished": True, "stopped": False}


def _tiny_member(host: int, store_port: int, file_store: str, n: int = 3):
    """Host ``host`` of ``n`` on gloo, with its membership, a ``tiny`` GPT (seed 0) and AdamW."""
    from geotrain.models.gpt import GPT, gpt_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{file_store}", rank=host, world_size=n)
    membership = Membership("127.0.0.1", store_port, host, list(range(n)), timeout_s=30)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return membership, model, optimizer, Communicator(membership=membership)


def _tiny_step(sync, optimizer, host: int, n: int) -> None:
    """Host ``host``'s local step ``n`` on its own batch (before ``after_step``)."""
    g = torch.Generator().manual_seed(1000 * host + n)
    xy = torch.randint(0, 256, (2, 17), generator=g)
    sync.model(xy[:, :-1], xy[:, 1:])[1].backward()
    sync.before_step()  # (DreamDDP lands its averages here)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@_saved
def _split_landing(
    host: int, store_port: int, file_store: str, final: bool = False, checked: bool = False
) -> dict:
    """SparseLoCo under --overlap auto, H=4, on 3 hosts, landing a period late: the gather
    launched at step 8 has arrived everywhere when host 2 is lost. At step 12 a check has asked
    for a timed outer step, which lands that gather and then gathers synchronously: host 0 lands
    it and fails at the barrier before its gather; host 1's wait for it fails. ``final``: the
    same in the end-of-run average after step 11 (land, then gather), redone as ``train`` does,
    leaving out the adopters' copies. ``checked``: contributions checked (the CLI's default
    among 3 or more); the checks each worker counted are returned."""
    from geotrain.ft.elastic import regroup
    from geotrain.sync import build_sync
    from geotrain.sync import sparseloco as sparseloco_module

    # the first verdict the same everywhere (15% of the period: overlap on), whatever each
    # worker's clock says; the redone one is the method's own (its agreement a collective)
    verdict = sparseloco_module.SparseLoCo._verdict
    sparseloco_module.SparseLoCo._verdict = lambda self, gather_s: (gather_s, 4.0, 0.15)
    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    if checked:
        comm = Communicator(membership=membership, max_norm_ratio=10.0)
    sync = build_sync("sparseloco", model, optimizer, comm, {"H": 4, "chunk": 256, "k": 8})

    def step(n: int) -> None:
        _tiny_step(sync, optimizer, host, n)

    for n in range(1, 12):
        step(n)
        sync.after_step()
        if n == 4:  # decided at the first outer step: overlapped, landing a period late
            assert sync.overlap
            sync.landing = 4
            sparseloco_module.SparseLoCo._verdict = verdict
    assert sync.in_flight.flying  # launched at step 8
    while not sync.in_flight.arrived():
        time.sleep(0.01)
    dist.barrier()
    if host == 2:
        os._exit(0)  # lost
    if not final:
        sync._again = ("a check (the test's)", 0)
        step(12)

    def lost(*args, **kwargs):
        raise RuntimeError("a member was lost")

    if host == 0 and final:
        comm.all_gather = lost  # the average's own gather (the one in flight has arrived)
    elif host == 0:
        comm.barrier = lost
    else:
        handle = sync.in_flight._handle

        def lost_wait(timeout=None):
            raise RuntimeError("a member was lost")

        handle.wait = lost_wait
    with contextlib.suppress(RuntimeError):
        sync.finalize() if final else sync.after_step()
        raise AssertionError("the step did not fail")
    if host == 0:
        del comm.__dict__["all_gather" if final else "barrier"]  # the Communicator's own again
    status = StepStatus(11, not final)
    reported = StepStatus(11, not final, not sync.in_flight.flying)  # what regroup reads
    before = sync._anchor.clone()
    event = regroup(membership, comm, sync, model, optimizer, status)
    rows = []
    if final:  # as train() redoes it
        copies = {event["members"].index(h) for h in event["behind"]}
        gather = comm.all_gather
        comm.all_gather = lambda t, async_op=False: rows.append(got := gather(t, async_op)) or got
        with comm.leaving_out(copies):
            sync.finalize()
    result = {
        "rows": rows,
        "event": event,
        "status": reported,
        "before": before,
        "anchor": sync._anchor.clone(),
        "params": flatten(list(model.parameters())).detach().clone(),
        "flying": sync.in_flight.flying,
        "landings": sync.in_flight.landings,
        "overlap": sync.overlap,
        "checked_hosts": sorted(comm.step_checked),  # (where checked: the hosts the check counted)
    }
    sync.close()
    return result


def _split_final_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _split_landing(host, store_port, file_store, out, final=True)


def _split_landing_checked(host: int, store_port: int, file_store: str, out: str) -> None:
    _split_landing(host, store_port, file_store, out, checked=True)


@_saved
def _late_transfers(host: int, store_port: int, file_store: str) -> dict:
    """A group formed under a 2 s bound, then given the collective timeout (30 s), as a
    regroup's are; host 0 sends 4 s late, through ``exchange`` (its waiter thread: a member's,
    which a newer epoch would interrupt) and through ``send_async``."""
    from torch.distributed import distributed_c10d

    from geotrain.comm.communicator import Communicator

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    store.add("late/up", 1)
    while int(store.add("late/up", 0)) < 2:  # both here: the 2 s bound is for the formation
        time.sleep(0.01)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("late", store), rank=host, world_size=2, timeout=timedelta(seconds=2)
    )
    distributed_c10d._set_pg_timeout(timedelta(seconds=30), dist.group.WORLD)
    comm = Communicator(timeout_s=30, membership=types.SimpleNamespace(epoch=1, published_leave=1))
    got = {}
    for how in ("exchange", "send_async"):
        sent = torch.arange(4.0) + (10 if how == "exchange" else 20)
        if host == 0:
            time.sleep(4.0)
            if how == "exchange":
                comm.exchange([(sent, 1, 0)], [])
            else:
                comm.send_async(sent, 1).wait()
        else:
            got[how] = torch.zeros(4)
            if how == "exchange":
                comm.exchange([], [(got[how], 0, 0)])
            else:
                comm.recv_async(got[how], 0).wait()
    return got


def test_a_transfer_in_a_regrouped_group_waits_the_collective_timeout_not_the_formations():
    """gloo times a send or receive by the timeout its group formed under, which
    ``_set_pg_timeout`` does not change: after a regroup, every hand-over and snapshot share
    longer than the formation bound failed (a 0.85 MB hand-over at 1 Mbit/s, in a soak)."""
    _, got = _hosts(_late_transfers, _master(), 2, kept=(0, 1))
    assert torch.equal(got["exchange"], torch.arange(4.0) + 10)
    assert torch.equal(got["send_async"], torch.arange(4.0) + 20)


@pytest.mark.parametrize("worker", [_split_landing, _split_landing_checked])
def test_a_message_in_flight_landed_by_one_survivor_and_not_another_is_sent_as_landed_not_resent(
    tmp_path, worker
):
    """A timed outer step lands the gather in flight, then gathers: host 0 landed it and failed
    after, host 1's wait failed. Both failed step 12's sync, but host 0 is further: were each to
    retry alone, host 1 would send the old message again where host 0 gathers the new one, and
    the collectives would pair wrongly. What host 1 lacks is the gather's result: host 0 sends
    it (a few KB, where its state is 0.85 MB), host 1 lands it as if the gather had completed
    there, its own message in it, and both redo the timed gather with their own states: the
    anchors and the models end bitwise equal, with nothing in flight. With contributions
    checked too (the CLI's default among 3 or more), where host 1 used to take host 0's whole
    state: the result's 3 rows are the group before's, which the check reads as that group's
    hosts on host 1 as it did on host 0 (read as the new group's 2 ranks, the third had none)."""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    h0, h1 = _hosts(worker, store, 3, (0, 1))
    assert h0["status"] == StepStatus(11, True, 1) and h1["status"] == StepStatus(11, True, 0)
    for h in (h0, h1):
        assert h["event"]["leader"] == 0 and h["event"]["behind"] == [] and h["event"]["caught_up"] == [1]
        assert 0 < h["event"]["handed_over_bytes"] < 50_000 and h["event"]["resume"].committed == 11
        assert not h["flying"] and h["overlap"] is not None  # the timed step decided
    assert h0["landings"] == 1 and h1["landings"] == 1  # the one gather, landed once on each
    assert torch.equal(h0["anchor"], h1["anchor"]) and torch.equal(h0["params"], h1["params"])
    if worker is _split_landing_checked:
        assert h0["checked_hosts"] == h1["checked_hosts"] == [0, 1, 2]
    assert not torch.equal(h0["anchor"], h0["before"])  # the redone gather moved it


def test_the_end_of_run_average_redone_after_a_split_landing_leaves_the_adopters_copy_out(tmp_path):
    """The end-of-run average lands the gather in flight and then gathers the last steps: host
    0 landed it and its gather failed, host 1's wait failed. Host 1 adopts host 0's state, and
    the average is redone with host 1's message empty (its copy of host 0's progress would
    count twice): both end on one model, the anchor."""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    h0, h1 = _hosts(_split_final_landing, store, 3, (0, 1))
    assert h0["status"] == StepStatus(11, False, 1) and h1["status"] == StepStatus(11, False, 0)
    for h in (h0, h1):  # (no sync failed after its local step: the result is not sent alone)
        assert h["event"]["leader"] == 0 and h["event"]["behind"] == [1] and h["event"]["caught_up"] == []
        (gathered,) = h["rows"]  # the redone average's one gather: nothing was in flight
        assert gathered[0].any() and not gathered[1].any()
        assert torch.equal(h["params"], h0["params"]) and not h["flying"]
    assert torch.equal(h0["anchor"], h1["anchor"]) and not torch.equal(h0["anchor"], h0["before"])


@_saved
def _joiner_from_state(host: int, store_port: int, file_store: str, algo: str) -> dict:
    """``algo`` on hosts 0 and 1 after step 8, a message in flight (SparseLoCo overlapped, landing
    a period late; CO2 landing 2 steps into the next period; Streaming DiLoCo's fragments); host
    2 joins (it trained alongside, and comes as a joiner: its state is dropped)."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import capture, encode, tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    frozen = model.ln_f.bias  # not trained (as LoRA's base weights)
    frozen.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)  # not trained either, and the same on every host
    options = {
        "sparseloco": {"H": 4, "chunk": 256, "k": 8, "overlap": True},
        "co2": {"H": 4, "tau": 2},
        "streaming": {"H": 8, "fragments": 2, "tau": 1},
        "dreamddp": {"H": 4, "compress": "int8", "replan_threshold": 0.0},
    }[algo]
    sync = build_sync(algo, model, optimizer, comm, options)
    if algo == "dreamddp":  # every layer once a period, round robin (no profile)
        names = [layer.name for layer in sync.layers]
        iterations = [[n for i, n in enumerate(names) if i % 4 == h] for h in range(4)]
        sync.set_plan({"schedule": {"H": 4, "layers": names, "iterations": iterations,
                                    "assignment": [i % 4 for i in range(len(names))]}})  # fmt: skip
    if host == 2:  # the joiner's differs (built from another checkpoint, say)
        with torch.no_grad():
            frozen.add_(1.0)
            for refs in getattr(sync, "_ref", {}).values():  # and DreamDDP's references
                refs[0].add_(1.0)

    def step(n: int) -> None:
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()

    def from_shared() -> bool:  # the parameters are the state the members share
        if algo == "dreamddp":  # its codec's references
            pairs = [
                (p, sync._ref[layer.name][i]) for layer in sync.layers for i, p in enumerate(layer.params)
            ]
            return all(torch.equal(p, ref) for p, ref in pairs)
        if algo == "streaming":
            pairs = zip(sync.fragments, sync._global, strict=True)
            return all(torch.equal(flatten(list(f)), theta) for f, theta in pairs)
        return torch.equal(sync._local(), sync._anchor) and torch.equal(sync._start, sync._anchor)

    for n in range(1, 9):
        step(n)
    state = capture(
        step=8, model=model, optimizer=optimizer, sync=sync, generators={}, progress={},
        replicated=set(), copy=False,
    )  # fmt: skip
    sizes = {part: len(encode(state["parts"][part])) for part in ("model", "sync")}
    status = StepStatus(-1, False) if host == 2 else StepStatus(8, False)
    frozen_before = frozen.detach().clone()
    loaded = []  # the entries a hand-over's model part brought
    load = model.load_state_dict
    model.load_state_dict = lambda sd, strict=True: loaded.extend(sd) or load(sd, strict=strict)
    event = regroup(membership, comm, sync, model, optimizer, status)
    model.load_state_dict = load
    # a message in flight that arrived on every member before the regroup: its result, kept,
    # goes with the state, for the joiner to land it as they do (SparseLoCo's, CO2's)
    primed = sync.in_flight.primed_result if sync.in_flight is not None else None
    sizes["landing"] = primed.numel() * primed.element_size() if primed is not None else 0
    if algo not in ("sparseloco", "co2"):  # (the algorithms that keep one: placed by message)
        assert primed is None
    after = {
        "params": flatten(list(model.parameters())).detach().clone(),
        "from_shared": from_shared(),
        "shared": tensors_digest(sync.shared_state()),
        "frozen": frozen.detach().clone(),
    }
    # What was in flight lands, the joiner's part empty. Admitted deferred (SparseLoCo, CO2), the
    # joiner skips its steps to the members' next sync (as train() does), left out of it.
    joiners = frozenset(event["members"].index(h) for h in event["deferred"])
    for n in range(9, 13):
        deferring = n <= event["deferred_until"]
        if not (deferring and comm.rank in joiners):
            _tiny_step(sync, optimizer, host, n)
        with comm.leaving_out(joiners) if n == event["deferred_until"] else contextlib.nullcontext():
            sync.after_step()
    if membership.sending is not None:
        membership.sending.finish()
    result = {"event": event, "after": after, "shared12": tensors_digest(sync.shared_state())}
    result |= {"frozen_before": frozen_before, "sizes": sizes, "loaded": loaded}
    sync.close()
    return result


def _sparseloco_joiner(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_from_state(host, store_port, file_store, out, "sparseloco")


def _co2_joiner(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_from_state(host, store_port, file_store, out, "co2")


def _streaming_joiner(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_from_state(host, store_port, file_store, out, "streaming")


def _dreamddp_joiner(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_from_state(host, store_port, file_store, out, "dreamddp")


@pytest.mark.parametrize("worker", [_sparseloco_joiner, _co2_joiner, _streaming_joiner, _dreamddp_joiner])
def test_a_joiner_gets_no_trained_parameters_and_starts_from_the_state_the_members_share(tmp_path, worker):
    """SparseLoCo, CO2, Streaming DiLoCo and DreamDDP with a codec: a joiner receives the
    algorithm's state (the anchor, the global fragments or the codec's references, its stand-in
    for the message in flight) and no trained parameters:
    between syncs each member's are its own (a period begun from its own message, the steps
    since), and the joiner's are rebuilt from the shared state, where its own empty message
    leaves its period's start. A frozen one (as LoRA's base weights) comes in the model part
    where the joiner's differs, and not at all where it is bitwise the leader's. The hand-over
    is the algorithm's state and little else; the members' shared digests are the joiner's,
    then and once what was in flight has landed."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")  # the same hosts: host 2 comes as a joiner
    store.add("epoch", 1)
    runs = _hosts(worker, store, 3, (0, 1, 2))
    joiner, leader = runs[2], runs[0]
    assert joiner["event"]["behind"] == [2] and joiner["event"]["leader"] == 0
    sizes = leader["sizes"]  # the leader's whole model part and algorithm state, encoded
    assert joiner["event"]["handed_over_bytes"] < sizes["sync"] + sizes["landing"] + sizes["model"] // 10
    assert joiner["after"]["from_shared"]
    # what is not trained comes in the model part, where the joiner's differs: it takes the
    # leader's; what it holds bitwise equal already does not come at all
    assert joiner["loaded"] == ["ln_f.bias"]
    assert all(torch.equal(r["after"]["frozen"], leader["after"]["frozen"]) for r in runs)
    assert not torch.equal(joiner["frozen_before"], leader["after"]["frozen"])
    assert all(r["after"]["shared"] == joiner["after"]["shared"] for r in runs)
    assert not torch.equal(runs[0]["after"]["params"], runs[1]["after"]["params"])  # each its own
    assert all(r["shared12"] == leader["shared12"] for r in runs)


@_saved
def _joiner_with_a_codec(host: int, store_port: int, file_store: str, codec: str, steps: int) -> dict:
    """Synchronous SGD through ``codec`` on 3 hosts, ``steps`` steps; then host 2 comes back as
    a joiner with a fresh codec (a restarted trainer's: no turn, no factors, no message count)
    and parameters of its own, and the three train 3 steps more. Returns each host's parameters
    and codec state entries that every worker must hold equal, after the admission and at the
    end."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    sync = build_sync("ssgd", model, optimizer, comm, {"compress": codec})
    for n in range(1, steps + 1):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
        sync.settle()  # (as ``Sync.step`` does)
    if host == 2:  # a restarted trainer: its own parameters and a fresh codec
        sync.codec.load_state_dict({"spec": sync.codec.spec(), "streams": []})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)

    def shared() -> str:  # the counters and factors (no error feedback), by stream
        streams = sync.codec.state_dict()["streams"]
        kept = [t for _, v in streams for name, t in sorted(v.items()) if _equal_everywhere(name)]
        return tensors_digest(kept) if kept else ""

    status = StepStatus(-1, False) if host == 2 else StepStatus(steps, False)
    event = regroup(membership, comm, sync, model, optimizer, status)
    own = sorted(n for _, v in sync.codec.state_dict()["streams"] for n in v if not _equal_everywhere(n))
    after = {"params": tensors_digest(list(model.parameters())), "shared": shared(), "own": own}
    for n in range(steps + 1, steps + 4):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
        sync.settle()
    end = {"params": tensors_digest(list(model.parameters())), "shared": shared()}
    sync.close()
    return {"event": event, "after": after, "end": end}


def _equal_everywhere(name: str) -> bool:
    """A codec state entry every worker must hold equal: the warm-up's message count, ACP-SGD's
    turn, the low-rank factors (not a residual, nor the shard owners' own)."""
    return name in ("messages", "step") or (name[:1] in ("p", "q") and name[1:].isdigit())


def _acpsgd_joiner_at_q(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_with_a_codec(host, store_port, file_store, out, "acpsgd:rank=2", 3)  # the members' next: Q


def _acpsgd_joiner_at_p(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_with_a_codec(host, store_port, file_store, out, "acpsgd:rank=2", 4)  # P, on its own factor


def _powersgd_joiner(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_with_a_codec(host, store_port, file_store, out, "powersgd:rank=2", 3)


def _warm_codec_joiner(host: int, store_port: int, file_store: str, out: str) -> None:
    _joiner_with_a_codec(host, store_port, file_store, out, "int8:warmup=2", 3)  # past its warm-up


@pytest.mark.parametrize(
    "worker", [_acpsgd_joiner_at_q, _acpsgd_joiner_at_p, _powersgd_joiner, _warm_codec_joiner]
)
def test_a_joiner_takes_the_codec_state_the_members_share(tmp_path, worker):
    """A joiner under synchronous SGD with a codec takes, with the model and the optimizer, the
    codec's entries every worker holds equal (ACP-SGD's turn and factors, PowerSGD's warm
    start, the warm-up's count), and none of a member's error feedback: then its messages are
    the members' size and its replica stays theirs, bitwise. On the code before, ACP-SGD's
    joiner sent P where the members sent Q (gloo aborted a member: "Received data size doesn't
    match expected size"), or, on P's turn, projected on its own factor and drifted off for
    good; int8's, still in its warm-up, sent uncompressed."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")  # the same hosts: host 2 comes back as a joiner
    store.add("epoch", 1)
    runs = _hosts(worker, store, 3, (0, 1, 2))
    assert runs[2]["event"]["behind"] == [2]
    for when in ("after", "end"):
        assert len({r[when]["params"] for r in runs}) == 1, when
        assert len({r[when]["shared"] for r in runs}) == 1, when
    assert runs[0]["end"]["shared"]  # (something shared to take: the test can fail)
    assert runs[2]["after"]["own"] == [] and runs[0]["after"]["own"]  # no member's residual came


@_saved
def _cut_short_at_different_messages(host: int, store_port: int, file_store: str, codec: str) -> dict:
    """Synchronous SGD through ``codec`` on 3 hosts, in several buckets, 3 steps. Step 4's
    collectives complete on all three, then host 2 is lost (it leaves the group, alive until the
    others are done: nothing of the old group's is cut). The survivors' waits fail at different
    messages: host 1 lands the first mean it waits for and fails at the second, host 0 fails at
    its first. Both redo step 4 on the new group, as ``train`` does, and train 2 steps more.
    Returns each survivor's ACP-SGD turns after the regroup, and its parameters and the codec
    entries that every worker must hold equal at the end."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    sync = build_sync("ssgd", model, optimizer, comm, {"compress": codec, "bucket_mb": 0.02})
    assert len(sync._buckets) >= 3
    for n in range(1, 4):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
        sync.settle()  # (as ``Sync.step`` does)
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    if host == 2:
        _tiny_step(sync, optimizer, host, 4)
        client.wait(["cut/0", "cut/1"], timedelta(seconds=60))
        return {}
    reduce, waited = sync.codec.reduce, []

    def cut_short(*args):
        pending = sync_reduce(*args)
        wait = pending.wait

        def failing_wait() -> None:
            waited.append(1)
            if len(waited) > host:  # host 1 lands one mean first
                raise RuntimeError("a member was lost")
            wait()

        pending.wait = failing_wait
        return pending

    sync_reduce, sync.codec.reduce = reduce, cut_short
    with contextlib.suppress(RuntimeError):
        _tiny_step(sync, optimizer, host, 4)
        raise AssertionError("the step did not fail")
    sync.codec.reduce = reduce
    if host == 1:  # the norm check had judged the mean it landed, and rejected host 2's part
        comm.step_checked |= {0, 1, 2}
        comm.step_rejected.add(2)
    regroup(membership, comm, sync, model, optimizer, StepStatus(3, False))
    turns = sorted({int(v["step"]) for _, v in sync.codec.state_dict()["streams"]})
    for n in range(4, 7):  # step 4 redone from its backward, then two more
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
        sync.settle()
    shared = [
        t for _, v in sync.codec.state_dict()["streams"] for k, t in sorted(v.items()) if _equal_everywhere(k)
    ]
    client.set(f"cut/{host}", "1")
    result = {
        "turns": turns,
        "params": tensors_digest(list(model.parameters())),
        "shared": tensors_digest(shared),
        "verdicts": comm.take_step_verdicts(),  # (the redone steps are not checked here)
    }
    sync.close()
    return result


def _acpsgd_cut_short(host: int, store_port: int, file_store: str, out: str) -> None:
    _cut_short_at_different_messages(host, store_port, file_store, out, "acpsgd:rank=2")


def test_survivors_cut_short_at_different_messages_of_a_step_redo_it_alike(tmp_path):
    """A failure reaches the survivors at different points of one step: host 1 has landed a
    bucket's mean (ACP-SGD's factor replaced) where host 0 landed none. On the code before, each
    redid the step from where it was, projecting on a factor of its own, and the replicas
    drifted apart for good. Each now rolls the codec's shared entries back to its last complete
    step first, and the survivors end bitwise equal. (PowerSGD's own warm start only changes
    what it sends: its reconstruction is from the two means, equal everywhere.)"""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    h0, h1 = _hosts(_acpsgd_cut_short, store, 3, (0, 1))
    assert h0["turns"] == h1["turns"] == [3]  # what step 3 left: the step redone from its turn
    assert h0["shared"] == h1["shared"]
    assert h0["params"] == h1["params"]
    # and the norm check's verdicts of the step cut short are forgotten with it: counted on host
    # 1 alone, its rejections in a row would run one ahead of host 0's (--max-rejections)
    assert h0["verdicts"] == h1["verdicts"] == (set(), set())


@_saved
def _deferred_over_a_landing(host: int, store_port: int, file_store: str, algo: str, arrived: bool) -> dict:
    """``algo`` with H=4, its message landing 2 steps into the next period (SparseLoCo overlapped;
    CO2's mean, in 4-bit messages or fp32): hosts 0 and 1 after step 5, the message launched at
    step 4 in flight; host 2 comes as a joiner. ``arrived``: host 2 trained alongside (its state
    is dropped) and step 4's collective arrived everywhere before the regroup; else host 2 is a
    replacement that never sent its part, and hosts 0 and 1 send theirs again."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    checked = algo.endswith("-checked")
    if checked:  # contributions checked (the CLI's default among 3 or more): a mean's screen is a
        # collective, so host 2 takes part in step 4's (arrived)
        algo = algo.removesuffix("-checked")
        comm = Communicator(membership=membership, max_norm_ratio=10.0)
    options = {
        "sparseloco": {"H": 4, "chunk": 256, "k": 8, "overlap": True, "tau": 2},
        "co2": {"H": 4, "tau": 2},
        "co2-fp32": {"H": 4, "tau": 2, "bits": 32},
    }[algo]
    sync = build_sync(algo.removesuffix("-fp32"), model, optimizer, comm, options)
    for n in range(1, 6) if arrived or host != 2 else ():
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    flying = sync.in_flight.flying
    if arrived:  # step 4's collective, here and on the other two
        client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
        while not sync.in_flight.arrived():
            time.sleep(0.01)
        client.set(f"arrived/{host}", "1")
        client.wait([f"arrived/{h}" for h in range(3)], timedelta(seconds=30))
    weights = []  # how many sent a message into each mean landed (an fp32 mean's count is last)
    if algo == "co2-fp32":
        finish = sync.in_flight._finish
        sync.in_flight._finish = lambda landed: weights.append(float(landed[-1])) or finish(landed)
    elif algo == "co2":  # the 4-bit messages' decoder: the rows it took
        mean = sync.messages.mean
        sync.messages.mean = lambda *a: (lambda out: weights.append(float(sum(out[1]))) or out)(mean(*a))
    status = StepStatus(-1, False) if host == 2 else StepStatus(5, False)
    order = []  # the joiner's: its empty part of the landing, then its wait for the state
    if host == 2:
        launch_empty = sync.in_flight.launch_empty
        sync.in_flight.launch_empty = lambda *a: order.append("empty") or launch_empty(*a)
        exchange = comm.exchange
        # its hand-over takes 2.5 s more (a slow link) where the members send their message again
        delay = 0.0 if arrived and not checked else HAND_OVER_DELAY_S
        comm.exchange = lambda *a, **k: order.append("state") or time.sleep(delay) or exchange(*a, **k)
    event = regroup(membership, comm, sync, model, optimizer, status, steps=40)
    joiners = frozenset(event["members"].index(h) for h in event["deferred"])
    landing_s = None
    for n in range(6, 9):  # the joiner skips its steps to the members' next sync (train() does)
        if host != 2:
            _tiny_step(sync, optimizer, host, n)
        started = time.monotonic()
        with comm.leaving_out(joiners) if n == event["deferred_until"] else contextlib.nullcontext():
            sync.after_step()
        landing_s = time.monotonic() - started if n == 6 else landing_s
    if membership.sending is not None:
        membership.sending.finish()
    at8 = tensors_digest(sync.shared_state())
    for n in range(9, 13):  # step 8's message lands at 10, the joiner's in it its own
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    result = {"event": event, "flying": flying, "at8": at8, "at12": tensors_digest(sync.shared_state())}
    result["weights"] = weights if algo.startswith("co2") else None
    result["landing_s"], result["order"] = landing_s, order
    sync.close()
    return result


HAND_OVER_DELAY_S = 2.5


def _sparseloco_over_a_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_over_a_landing(host, store_port, file_store, out, "sparseloco", False)


def _co2_over_a_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_over_a_landing(host, store_port, file_store, out, "co2", False)


def _co2_checked_over_a_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_over_a_landing(host, store_port, file_store, out, "co2-checked", False)


def _co2_checked_over_an_arrived_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_over_a_landing(host, store_port, file_store, out, "co2-checked", True)


def _co2_fp32_checked_over_an_arrived_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_over_a_landing(host, store_port, file_store, out, "co2-fp32-checked", True)


def _co2_fp32_over_an_arrived_landing(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_over_a_landing(host, store_port, file_store, out, "co2-fp32", True)


@pytest.mark.parametrize(
    "worker, weights",
    [
        (_sparseloco_over_a_landing, None),
        # the senders each mean was taken over: step 4's landed at 6, step 8's at 10
        (_co2_over_a_landing, [2.0, 2.0]),  # 4-bit messages: the joiner's empty, not taken
        (_co2_fp32_over_an_arrived_landing, [3.0, 2.0]),  # arrived from the three (kept)
        # contributions checked (the CLI's default among 3 or more): the same, the kept gather's
        # 3 rows judged as the group before's hosts, on the joiner too (from the state)
        (_co2_checked_over_a_landing, [2.0, 2.0]),
        (_co2_checked_over_an_arrived_landing, [3.0, 2.0]),
        (_co2_fp32_checked_over_an_arrived_landing, [3.0, 2.0]),
    ],
)
def test_a_joiner_is_admitted_while_the_members_train_on_over_a_landing_inside_the_period(
    tmp_path, worker, weights
):
    """SparseLoCo whose gather lands inside the period (tau 2 of H 4), or CO2 whose mean does
    (its 4-bit messages gathered, or the fp32 all-reduce), a joiner arriving before the
    landing: the members no longer wait for its hand-over (the landing used to make every
    step a collective point, so every admission stopped them for a model's worth of the slow
    link). They train on; the joiner takes part in the landing with an empty message, sent
    before it waits for the state (where the members send theirs again: they do not wait at the
    landing for its hand-over, 2.5 s longer here; where the collective had arrived on every member
    before the regroup, each lands what arrived, the joiner too, from the state, the norm check
    reading a kept gather's rows as the hosts of the group before), and,
    skipping its steps, in their next sync with its part left out, weighing nothing in either;
    after step 12 all three hold the same anchor."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")  # the same hosts: host 2 comes as a joiner
    store.add("epoch", 1)
    runs = _hosts(worker, store, 3, (0, 1, 2))
    for r in runs:
        assert r["event"]["behind"] == [2], r["event"]
        assert r["event"]["deferred"] == [2] and r["event"]["deferred_until"] == 8, r["event"]
        assert (r["at8"], r["at12"]) == (runs[0]["at8"], runs[0]["at12"])
        assert r["weights"] == weights
    assert runs[0]["flying"] and runs[1]["flying"]
    assert runs[0]["at8"] != runs[0]["at12"]
    # Where the members send their message again, the joiner's empty one went out before it
    # waited for the state, and their landing at step 6 took well under its hand-over (where
    # it arrived, each lands what arrived: nothing to send, and no delay).
    early = weights != [3.0, 2.0]
    assert runs[2]["order"] == (["empty", "state"] if early else ["state"]), runs[2]["order"]
    landings = [r["landing_s"] for r in runs[:2]]
    assert max(landings) < HAND_OVER_DELAY_S / 2, landings


def _to_step_6_then_lose(sync, optimizer, host: int, store_port: int, lost: int, hosts: int = 3):
    """Steps 1-6 on each of the ``hosts`` hosts (step 4's collective, where one flies, arrives
    everywhere), then host ``lost`` exits. Returns the step (a local step, then ``after_step``)."""

    def step(n: int) -> None:
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()

    for n in range(1, 7):
        step(n)
    while sync.in_flight.flying and not sync.in_flight.arrived():  # step 4's gather, here
        time.sleep(0.01)
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    client.set(f"arrived/{host}", "1")
    client.wait([f"arrived/{h}" for h in range(hosts)], timedelta(seconds=30))
    if host == lost:
        os._exit(0)  # lost after its part of step 4's gather has gone everywhere
    return step


@_saved
def _across_an_overlapped_sync(host: int, store_port: int, file_store: str, algo: str) -> dict:
    """``algo`` (SparseLoCo overlapped; CO2) with H=4, each message landing at the next outer
    step: all three hosts take steps 1-6 (step 4's collective arrives everywhere), then host 2 is
    lost. Host 0 goes on to step 9 (at 8 it lands step 4's message and launches its own, which
    host 2 never joins); host 1 stops at step 6, short of that sync. ``co2-checked``: CO2's
    4-bit messages landing 2 steps into the period (step 4's landed at 6 on all three), with
    contributions checked (the CLI's default among 3 or more)."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    options = {
        "sparseloco": {"H": 4, "chunk": 256, "k": 8, "overlap": True},
        "co2": {"H": 4, "tau": 4},
        "co2-checked": {"H": 4, "tau": 2},
        "sparseloco-checked": {"H": 4, "chunk": 256, "k": 8, "overlap": True},
    }[algo]
    if algo.endswith("-checked"):
        algo, comm = algo.removesuffix("-checked"), Communicator(membership=membership, max_norm_ratio=10.0)
    sync = build_sync(algo, model, optimizer, comm, options)
    step = _to_step_6_then_lose(sync, optimizer, host, store_port, 2)
    if host == 0:
        for n in range(7, 10):
            step(n)
    done = 9 if host == 0 else 6
    event = regroup(membership, comm, sync, model, optimizer, StepStatus(done, False), steps=40)
    losses = []
    for n in range(done + 1, 13):  # step 8's gather: host 1 launches it, host 0 sends it again
        step(n)
        if n > event["quiet_through"]:  # an evaluation at every step, as train() makes them
            losses.append(comm.mean_scalars([float(host)])[0])
    result = {"event": event, "anchor": tensors_digest(sync.shared_state()), "losses": losses}
    sync.close()
    return result


def _sparseloco_across_a_sync(host: int, store_port: int, file_store: str, out: str) -> None:
    _across_an_overlapped_sync(host, store_port, file_store, out, "sparseloco")


def _co2_across_a_sync(host: int, store_port: int, file_store: str, out: str) -> None:
    _across_an_overlapped_sync(host, store_port, file_store, out, "co2")


def _co2_checked_across_a_sync(host: int, store_port: int, file_store: str, out: str) -> None:
    _across_an_overlapped_sync(host, store_port, file_store, out, "co2-checked")


def _sparseloco_checked_across_a_sync(host: int, store_port: int, file_store: str, out: str) -> None:
    _across_an_overlapped_sync(host, store_port, file_store, out, "sparseloco-checked")


@pytest.mark.parametrize(
    "worker",
    [
        _sparseloco_across_a_sync,
        _co2_across_a_sync,
        _co2_checked_across_a_sync,
        _sparseloco_checked_across_a_sync,
    ],
)
def test_a_member_past_an_overlapped_sync_and_one_short_of_it_go_on_each_from_its_own_step(tmp_path, worker):
    """SparseLoCo (or CO2), each outer step's message landing a period late: host 2 is lost after step 6,
    host 0 is at step 9 (its step-8 message in flight, never gathered with host 2's), host 1 at
    step 6 (step 4's gather arrived). They need no state from each other: host 1 lands step 4's
    gather from what arrived, nothing sent again, and launches step 8's message at its own step
    8, which host 0 sends again at its step 12 in the new group. Host 1 used to take host 0's
    whole state (a model's worth on the slow link, cut by the next kill under a kill every 20 s).
    At step 12 both hold the same anchor. With contributions checked (the CLI's default among 3
    or more), where host 1 used to take host 0's state (a survivor's place was not read from its
    message there): SparseLoCo the same, the kept gather's 3 rows judged as the group before's
    hosts; CO2 landing 2 steps in, where host 1 has nothing in flight and host 0 sends step 8's
    message again at its step 10."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1")  # host 2 was lost
    store.add("epoch", 1)
    h0, h1 = _hosts(worker, store, 3, (0, 1))
    for h in (h0, h1):
        assert h["event"]["behind"] == [] and h["event"]["handed_over_bytes"] == 0, h["event"]
    assert [(h["event"]["resume"].committed, h["event"]["resume"].local_done) for h in (h0, h1)] == [
        (9, False),
        (6, False),
    ]
    assert h0["anchor"] == h1["anchor"]
    # Evaluations (collectives on the group) only from the next sync on: one at step 10 would
    # pair on host 0 with host 1's launch of step 8's message.
    assert h0["event"]["quiet_through"] == 11 and h0["losses"] == h1["losses"] == [0.5]


@_saved
def _a_period_behind(
    host: int, store_port: int, file_store: str, checked: bool, lost: int = 2, mixed: str = ""
) -> dict:
    """CO2 with H=4 (4-bit messages), each mean landing at the next sync (tau 4): all three
    take steps 1-6 (step 4's gather arrives everywhere), then host ``lost`` is lost. The first
    other host (the leader) lands step 4's gather at step 8, launches its own (which the lost
    host never joins) and goes on to step 9; the next one's wait for step 4's gather fails at
    its step 8 (the lost peer's last chunk did not reach it). ``checked``: contributions
    checked. With host 0 lost, each survivor's rank in the new group is not the one it sent as.
    ``mixed``: four hosts, host 3 lost, and host 2 as the leader but a step short of it (after
    step 8, its step-8 message in flight): at the leader's place; ``"leader failed"``: the
    leader's own sync at 12 failed (its wait for step 8's gather), host 2 after step 10, as a
    CO2 soak met it."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    n, leader_failed = (4 if mixed else 3), mixed == "leader failed"
    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store, n)
    if checked:
        comm = Communicator(membership=membership, max_norm_ratio=10.0)
    sync = build_sync("co2", model, optimizer, comm, {"H": 4, "tau": 4})
    step = _to_step_6_then_lose(sync, optimizer, host, store_port, lost, n)
    step(7)
    survivors = sorted(set(range(n)) - {lost})

    def lost_wait(timeout=None):
        raise RuntimeError("a member was lost")

    def fail_at(k: int) -> StepStatus:  # its wait for the landing at step k fails
        sync.in_flight._handle.wait = lost_wait
        with contextlib.suppress(RuntimeError):
            step(k)
            raise AssertionError("the step did not fail")
        return StepStatus(k - 1, True)

    last = {survivors[0]: 11 if leader_failed else 9, 2: 10 if leader_failed else 8}.get(host)
    if last is None or (host == 2 and not mixed):
        status = fail_at(8)
    else:
        for k in range(8, last + 1):
            step(k)
        status = fail_at(12) if leader_failed and host == survivors[0] else StepStatus(last, False)
    event = regroup(membership, comm, sync, model, optimizer, status, steps=40)
    for k in range(event["resume"].done + 1, 13):  # step 8's gather: host 1 launched it in its redo
        step(k)
    model_bytes = sum(4 * p.numel() for p in model.parameters())
    result = {"event": event, "anchor": tensors_digest(sync.shared_state()), "model_bytes": model_bytes}
    sync.close()
    return result


def _a_period_behind_checked(host: int, store_port: int, file_store: str, out: str) -> None:
    _a_period_behind(host, store_port, file_store, out, True)


def _a_period_behind_unchecked(host: int, store_port: int, file_store: str, out: str) -> None:
    _a_period_behind(host, store_port, file_store, out, False)


def _a_period_behind_ranks_moved(host: int, store_port: int, file_store: str, out: str) -> None:
    _a_period_behind(host, store_port, file_store, out, True, lost=0)


def _a_period_behind_beside_one_at_the_leaders_place(
    host: int, store_port: int, file_store: str, out: str
) -> None:
    _a_period_behind(host, store_port, file_store, out, True, lost=3, mixed="short")


def _a_period_behind_beside_one_at_a_failed_leaders_place(
    host: int, store_port: int, file_store: str, out: str
) -> None:
    _a_period_behind(host, store_port, file_store, out, True, lost=3, mixed="leader failed")


@pytest.mark.parametrize(
    "worker",
    [
        _a_period_behind_unchecked,
        _a_period_behind_checked,
        _a_period_behind_ranks_moved,
        _a_period_behind_beside_one_at_the_leaders_place,
        _a_period_behind_beside_one_at_a_failed_leaders_place,
    ],
)
def test_a_member_a_period_behind_the_leader_gets_the_landing_it_lacks_not_the_state(tmp_path, worker):
    """CO2 landing a period late: host 0 landed step 4's gather at its step 8 and went on to
    step 9, its step-8 message in flight; host 1's wait for that gather failed at its step 8.
    Host 1 lacks that gather's result alone: host 0 sends it (three 4-bit messages, under half
    a model's worth, where its state is three), host 1's redo lands it and launches step 8's message,
    which host 0 sends again at its step 12. It used to take host 0's whole state (3 of the 23
    fault regroups of a CO2 soak at 2 Mbit/s). Both end step 12 with the same anchor. Also
    where host 0 is lost and each survivor's rank moves (host 2 sent as rank 2, lands as rank
    1: each reads its own row by the rank it sent as), where the one behind took the state too
    (1 of 24 fault regroups in a soak, a rank having moved). And among four, host 3 lost, with
    host 2 after step 8 at the leader's place: it goes on from its own step, and host 1 gets
    the landing alone, where both took host 0's state (2 of 22 fault regroups in a soak); and
    so where host 0's own sync at 12 failed too (host 2 after step 10 meets its redo there)."""
    failed = worker is _a_period_behind_beside_one_at_a_failed_leaders_place
    mixed = failed or worker is _a_period_behind_beside_one_at_the_leaders_place
    store = _master()
    Epochs(store, tmp_path, 4 if mixed else 3)
    kept = (1, 2) if worker is _a_period_behind_ranks_moved else (0, 1, 2) if mixed else (0, 1)
    store.set("members/1", ",".join(map(str, kept)))  # the other host was lost
    store.add("epoch", 1)
    hosts = _hosts(worker, store, 4 if mixed else 3, kept)
    for h in hosts:
        assert h["event"]["leader"] == kept[0] and h["event"]["behind"] == [], h["event"]
        assert h["event"]["caught_up"] == [kept[1]], h["event"]
        # the old group's 4-bit messages, an eighth of the model each (the state: 3 models' worth)
        assert 0 < h["event"]["handed_over_bytes"] < h["model_bytes"] * (4 if mixed else 3) / 7
    assert (hosts[0]["event"]["resume"].done, hosts[1]["event"]["resume"].done) == (12 if failed else 9, 8)
    if mixed:  # its own step
        assert hosts[2]["event"]["resume"] == StepStatus(10 if failed else 8, False)
    assert len({h["anchor"] for h in hosts}) == 1


@_saved
def _co2_mean_launched(host: int, store_port: int, file_store: str, screen_fails: bool) -> dict:
    """CO2 with fp32 messages (``bits`` 32: a mean all-reduce) under the norm check, H=4, each
    mean landing 2 steps into the period: all three take steps 1-6, then host 2 is lost.
    ``screen_fails``: hosts 0 and 1 take step 8's local step and its launch fails in the norm
    check's screen (a collective before the mean, which the lost host never joins): nothing is
    in flight, and the regroup's redo makes the message again. Otherwise the loss is found
    after step 7 and step 8 launches on the new group. Both train to step 12."""
    from geotrain.ft.elastic import regroup
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, _ = _tiny_member(host, store_port, file_store)
    comm = Communicator(membership=membership, max_norm_ratio=10.0)
    sync = build_sync("co2", model, optimizer, comm, {"H": 4, "tau": 2, "bits": 32})
    step = _to_step_6_then_lose(sync, optimizer, host, store_port, 2)
    step(7)
    status = StepStatus(7, False)
    if screen_fails:
        screen = comm._screen

        def lost(tensor):
            comm._screen = screen  # once: the redo screens on the new group
            raise RuntimeError("a member was lost")

        comm._screen = lost
        with contextlib.suppress(RuntimeError):
            step(8)
            raise AssertionError("the launch did not fail")
        assert not sync.in_flight.flying  # nothing is in flight to be sent again
        status = StepStatus(7, True)
    event = regroup(membership, comm, sync, model, optimizer, status, steps=40)
    for k in range(event["resume"].done + 1, 13):  # step 8's mean lands at 10; 12's launches
        step(k)
    result = {
        "event": event,
        "anchor": tensors_digest(sync.shared_state()),
        "model": tensors_digest([p.detach() for p in model.parameters()]),
    }
    sync.close()
    return result


def _co2_screen_failed(host: int, store_port: int, file_store: str, out: str) -> None:
    _co2_mean_launched(host, store_port, file_store, out, True)


def _co2_screen_passed(host: int, store_port: int, file_store: str, out: str) -> None:
    _co2_mean_launched(host, store_port, file_store, out, False)


def test_a_co2_mean_whose_screen_failed_at_launch_is_made_again_once_by_the_redo(tmp_path):
    """An fp32 CO2 mean under the norm check: its launch failed in the screen before the mean
    (a collective too) when host 2 was lost. The redo makes step 8's message again from the same
    state and sends it once: both survivors end step 12 with the anchor and the model of the
    run where the loss was found before step 8's launch, bitwise (a message kept from the failed
    launch and sent again would land twice: ``InFlight.launch_weighted``)."""
    runs = []
    for worker in (_co2_screen_failed, _co2_screen_passed):
        store, control = _master(), tmp_path / worker.__name__
        control.mkdir()
        Epochs(store, control, 3)
        store.set("members/1", "0,1")  # host 2 was lost
        store.add("epoch", 1)
        runs.append(_hosts(worker, store, 3, (0, 1)))
    failed, passed = runs
    for h in failed:
        resume = h["event"]["resume"]
        assert (resume.committed, resume.local_done, h["event"]["behind"]) == (7, True, []), h["event"]
    assert failed[0]["anchor"] == failed[1]["anchor"]
    assert [(h["anchor"], h["model"]) for h in failed] == [(h["anchor"], h["model"]) for h in passed]


@_saved
def _resumed_hand_over(host: int, store_port: int, file_store: str) -> dict:
    """SparseLoCo (H=4) on hosts 0 and 1 after step 8; host 2 joins. Hosts 0 and 1 hold the
    state equal and send it in stripes; host 1 is killed as its stripes should go. Host 0's go
    only once the joiner's hand-over was cut short: those it had asked for (its window) arrive
    on the old group all the same. The joiner keeps them, and the retry (epoch 3: hosts 0 and
    2), after host 0 trained a step on (its state's step moved, its anchor did not), sends only
    the rest: the chunks that changed, those host 1 was to send and those not asked for."""
    from geotrain.ft import handover
    from geotrain.ft.state import tensors_digest
    from geotrain.sync import build_sync

    handover.CHUNK_BYTES = 16 * 1024  # several chunks per part of ``tiny``'s state
    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    sync = build_sync("sparseloco", model, optimizer, comm, {"H": 4, "chunk": 256, "k": 8, "overlap": False})
    sync.defers_admission = lambda: False  # the members wait in the hand-over (not deferred)
    for n in range(1, 9):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    if host == 2:  # it comes as a joiner: none of the members' state (it trained alongside)
        with torch.no_grad():
            sync._anchor.add_(1.0)
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    stop = threading.Event()

    def heartbeat() -> None:
        beat = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
        while not stop.is_set():
            membership.observe(beat, int(beat.add("epoch", 0)))
            time.sleep(0.05)

    threading.Thread(target=heartbeat, daemon=True).start()
    if host == 1:

        def killed(*args, **kwargs):
            client.set("test/lost", "1")
            os._exit(0)

        comm.exchange = killed
    if host == 0:
        exchange = comm.exchange

        def late(*args, **kwargs):
            client.wait(["test/cut"], timedelta(seconds=60))  # the joiner's hand-over was cut short
            del comm.__dict__["exchange"]  # the Communicator's own again
            exchange(*args, **kwargs)

        comm.exchange = late
    status = StepStatus(-1, False) if host == 2 else StepStatus(8, False)
    events, errors = [], []
    while True:
        before = comm.stats.sent_bytes, comm.stats.recv_bytes
        try:
            events.append(regroup(membership, comm, sync, model, optimizer, status))
        except RuntimeError as e:  # cut short: regroup again once the loss is published
            errors.append(type(e).__name__)
            client.set("test/cut", "1")
        moved = comm.stats.sent_bytes - before[0], comm.stats.recv_bytes - before[1]
        if membership.epoch == 3:
            break
        if host == 0:  # it trains a step on before the retry: the step in its state moves
            _tiny_step(sync, optimizer, host, 9)
            sync.after_step()
            status = StepStatus(9, False)
        while membership.published_leave < 3:
            time.sleep(0.05)
    stop.set()
    result = {"events": events, "errors": errors, "moved": moved}
    result["shared"] = tensors_digest(sync.shared_state())
    sync.close()
    return result


def test_a_hand_over_cut_short_by_a_lost_server_keeps_what_arrived_and_the_retry_sends_the_rest(tmp_path):
    """The Streaming DiLoCo soak (a kill every 20 s, 1 Mbit/s): a joiner's 10 s hand-over was cut
    short by a kill again and again, each retry from nothing, until the run stood still. Here
    the joiner keeps what it had asked for of host 0's stripe, host 1's being lost, and in the
    retry receives only what it lacks, not the whole state, and loads the members' state."""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    epochs.join(2)  # epoch 2 = [0, 1, 2]: host 2 a joiner

    def coordinator() -> None:
        store.wait(["test/lost"], timedelta(seconds=60))
        epochs.leave({1}, "exited")  # epoch 3 = [0, 2]

    watcher = threading.Thread(target=coordinator, daemon=True)
    watcher.start()
    h0, h2 = _hosts(_resumed_hand_over, store, 3, (0, 2))
    # Host 0's first hand-over is cut short too: the joiner, abandoned, asks for no more of it
    assert h0["errors"] == ["MembershipChanged"] and h2["errors"] == ["MembershipChanged"]
    (second,) = h0["events"]
    (admitted,) = h2["events"]
    assert admitted["epoch"] == 3 and admitted["members"] == [0, 2] and admitted["stripes"]["sync"] == 1
    total = admitted["handed_over_bytes"]
    kept = admitted["resumed_bytes"]
    # What it had asked host 0 for before the cut (its first receives, two: the window) came
    # after it and was kept; the rest, not asked for on the old group, came in the retry
    assert second["resumed_bytes"] == kept and 0 < kept <= 2 * 16 * 1024 + 4096, (kept, total)
    sent, _ = h0["moved"]  # host 0's bytes in the retry: the rest, and the regroup's control
    assert sent == total - kept, (sent, total, kept)
    assert h0["shared"] == h2["shared"]


@_saved
def _streaming_a_step_behind(host: int, store_port: int, file_store: str) -> dict:
    """Streaming DiLoCo (H=8, 2 fragments, tau=1: fragment 1 launched at step 7, landing at 8) on
    3 hosts; host 0 finishes step 8, hosts 1 and 2 stop after step 7 (their fragment in
    flight). Both are behind and adopt the leader's state, which differs from theirs in
    fragment 1's global parameters and momentum only."""
    from geotrain.ft.state import capture, encode, tensor_digest, tensors_digest
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    sync = build_sync("streaming", model, optimizer, comm, {"H": 8, "fragments": 2, "tau": 1})
    last = 8 if host == 0 else 7
    for n in range(1, last + 1):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    state = capture(
        step=last, model=model, optimizer=optimizer, sync=sync, generators={}, progress={},
        replicated=set(), copy=False,
    )  # fmt: skip
    whole = len(encode(state["parts"]["sync"]))
    event = regroup(membership, comm, sync, model, optimizer, StepStatus(last, False))
    shared8 = tensors_digest(sync.shared_state())
    momentum8 = tensor_digest([o.state_dict()["state"] for o in sync.outer_optimizers])
    for n in range(9, 13):  # on together: fragment 0 lands at 12
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    result = {
        "event": event,
        "whole": whole,
        "shared8": shared8,
        "momentum8": momentum8,
        "shared12": tensors_digest(sync.shared_state()),
    }
    sync.close()
    return result


def test_a_survivor_a_step_behind_receives_only_the_tensors_it_lacks(tmp_path):
    """The Streaming DiLoCo soak: a survivor a step behind the leader took the whole state (1.1 MB,
    10 s at 1 Mbit/s) at a third of the regroups. What it lacks is what the leader's last landing
    changed: one fragment's global parameters and outer momentum. The rest of the algorithm's
    state it holds bitwise equal (by digest) stays out of the hand-over; it still ends with the
    members' state, and they train on together."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")  # the same hosts, regrouped where they stopped
    store.add("epoch", 1)
    h0, h1, h2 = _hosts(_streaming_a_step_behind, store, 3, (0, 1, 2))
    event = h2["event"]
    assert event["leader"] == 0 and event["behind"] == [1, 2] and event["resume"].committed == 8
    # fragment 1 of 2 (and what goes with any hand-over): about half the state, not all of it
    assert 0.4 * h0["whole"] < event["handed_over_bytes"] < 0.6 * h0["whole"], (event, h0["whole"])
    assert h0["shared8"] == h1["shared8"] == h2["shared8"]
    assert h0["momentum8"] == h1["momentum8"] == h2["momentum8"]  # the held one theirs, the other sent
    assert h0["shared12"] == h1["shared12"] == h2["shared12"]


@_saved
def _deferred_joiner(host: int, store_port: int, file_store: str, refault: bool = False) -> dict:
    """Local SGD (H=4) on hosts 0 and 1 after step 8; host 2 joins, deferred: the members train
    steps 9-12 while it receives, it skips them, and the average of step 12 leaves it out."""
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    if refault:  # its state an anchor, the same until the next sync (localsgd's: the parameters)
        sync = build_sync(
            "sparseloco", model, optimizer, comm, {"H": 4, "chunk": 256, "k": 8, "overlap": False}
        )
    else:
        sync = build_sync("localsgd", model, optimizer, comm, {"H": 4})
    for n in range(1, 9):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    status = StepStatus(-1, False) if host == 2 else StepStatus(8, False)
    event = regroup(membership, comm, sync, model, optimizer, status, steps=40)
    left_out = frozenset(event["members"].index(h) for h in event["deferred"])
    before, again = None, None
    for n in range(9, 13):
        if host != 2:
            _tiny_step(sync, optimizer, host, n)
        if n == 10 and refault:  # a regroup before the meeting: the joiner is admitted afresh
            if host == 0:
                client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
                client.set("members/2", "0,1,2")
                client.add("epoch", 1)
            status = StepStatus(-1, False) if host == 2 else StepStatus(10, False)
            again = regroup(membership, comm, sync, model, optimizer, status, steps=40)
            left_out = frozenset(again["members"].index(h) for h in again["deferred"])
        if n == 12:
            before = flatten(list(model.parameters())).detach().clone()
            with comm.leaving_out(left_out):
                sync.after_step()
        else:
            sync.after_step()
    if membership.sending is not None:
        membership.sending.finish()
    after = flatten(list(model.parameters())).detach().clone()
    sync.close()
    return {"event": event, "again": again, "before": before, "after": after}


def _deferred_joiner_refault(host: int, store_port: int, file_store: str, out: str) -> None:
    _deferred_joiner(host, store_port, file_store, out, refault=True)


@pytest.mark.parametrize("worker", [_deferred_joiner, _deferred_joiner_refault])
def test_a_deferred_joiner_meets_the_members_at_their_next_sync_and_weighs_nothing_in_it(tmp_path, worker):
    """The members do not wait for the hand-over (they train steps 9-12 meanwhile); the joiner,
    its state that of step 8, skips to step 12, where the average is the two members' alone,
    and all three hold it. With a regroup after step 10 (a fault elsewhere): the joiner is
    admitted afresh, deferred to the same sync, and receives only the chunks that changed (the
    step in the state), not the state again."""
    store = _master()
    Epochs(store, tmp_path, 3)
    store.set("members/1", "0,1,2")
    store.add("epoch", 1)
    h0, h1, h2 = _hosts(worker, store, 3, (0, 1, 2))
    for h in (h0, h1, h2):
        assert h["event"]["deferred"] == [2] and h["event"]["deferred_until"] == 12
    if worker is _deferred_joiner_refault:  # (SparseLoCo)
        again = h2["again"]
        assert again["deferred"] == [2] and again["deferred_until"] == 12 and again["behind"] == [2]
        assert again["resumed_bytes"] > 0.8 * again["handed_over_bytes"], again
        assert torch.equal(h0["after"], h1["after"]) and torch.equal(h0["after"], h2["after"])
        return
    mean = (h0["before"] + h1["before"]) / 2
    assert torch.allclose(h0["after"], mean, atol=1e-6)  # the joiner's replica weighs nothing
    assert not torch.allclose(h0["after"], (h0["before"] + h1["before"] + h2["before"]) / 3, atol=1e-4)
    assert torch.equal(h0["after"], h1["after"]) and torch.equal(h0["after"], h2["after"])


class _Failing:
    """A collective's handle whose wait fails as a lost member's does (``after``: once the
    collective under it has completed, as where the lost peer had sent its last chunk)."""

    def __init__(self, handle, after: bool) -> None:
        self.handle, self.after = handle, after

    def is_completed(self) -> bool:
        return self.handle.is_completed() if self.after else False

    def wait(self, timeout=None):
        if self.after:
            self.handle.wait()
        raise RuntimeError("a member was lost")


class _Recorded:
    """A collective's handle whose result is kept in ``rows`` once waited for."""

    def __init__(self, handle, rows: list) -> None:
        self.handle, self.rows = handle, rows

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def wait(self, timeout=None):
        got = self.handle.wait()
        self.rows.append(got.clone())
        return got


@_saved
def _streaming_stages(host: int, store_port: int, file_store: str, bits: int = 4) -> dict:
    """Streaming DiLoCo (H=12, 3 fragments, tau 1) on 3 hosts ends its run after step 11 with a
    fragment in flight: its end-of-run average lands it, then averages fragments 0, 1 and 2
    (stages 0, 1, 2), a gather each. Stage 0 completes on every host, but host 1's wait for
    it fails; host 0 goes on to stage 1, whose wait fails; host 2 is lost there. The two
    survivors regroup and redo the average as ``train`` does, leaving out the adopters' copies."""
    from geotrain.ft.elastic import regroup
    from geotrain.sync import build_sync

    membership, model, optimizer, comm = _tiny_member(host, store_port, file_store)
    options = {"H": 12, "fragments": 3, "tau": 1, "bits": bits}
    sync = build_sync("streaming", model, optimizer, comm, options)
    for n in range(1, 12):
        _tiny_step(sync, optimizer, host, n)
        sync.after_step()
    assert sync.in_flight.flying  # fragment 2's, launched at step 11
    gather, calls = comm.all_gather, []

    def failing(t, async_op=False):  # the average's gathers: stage 0, then stage 1
        calls.append(t.numel())
        if host == 2 and len(calls) == 2:
            os._exit(0)  # lost before stage 1
        handle = gather(t, async_op)
        if (host, len(calls)) == (1, 1):
            return _Failing(handle, after=True)
        return _Failing(handle, after=False) if (host, len(calls)) == (0, 2) else handle

    comm.all_gather = failing
    with contextlib.suppress(RuntimeError):
        sync.finalize()
        raise AssertionError("the average did not fail")
    comm.all_gather = gather
    reported = (sync.final_progress(), sync.in_flight.flying)
    # the replica once fragment 2's message in flight has landed (its outer step and merge),
    # and where each fragment's last sync put it
    replica = [flatten(list(f)).detach().clone() for f in sync.fragments]
    synced = [t.clone() for t in sync._global]
    event = regroup(membership, comm, sync, model, optimizer, StepStatus(11, False))
    rows = []
    copies = {event["members"].index(h) for h in event["behind"]}
    comm.all_gather = lambda t, async_op=False: _Recorded(gather(t, async_op), rows)
    with comm.leaving_out(copies):
        sync.finalize()
    comm.all_gather = gather
    result = {
        "event": event,
        "reported": reported,
        "rows": rows,
        "replica": replica,
        "synced": synced,
        "fragments": [flatten(list(f)).detach().clone() for f in sync.fragments],
        "global": [t.clone() for t in sync._global],
        "progress": sync.final_progress(),
    }
    sync.close()
    return result


def _streaming_stages_fp32(host: int, store_port: int, file_store: str, out: str) -> None:
    _streaming_stages(host, store_port, file_store, out, bits=32)


@pytest.mark.parametrize("worker", [_streaming_stages, _streaming_stages_fp32])
def test_survivors_at_different_stages_of_streamings_end_of_run_average_follow_the_furthest(tmp_path, worker):
    """Host 0 completed stage 0 of Streaming DiLoCo's end-of-run average and failed at stage 1;
    host 1 failed at stage 0. Both have a message in flight, at the same step: only the stage
    tells them apart. Were each to redo its own stage, host 0 would gather fragment 1 where
    host 1 gathers fragment 0. Host 1 adopts host 0's state (fragment 0 final, its stage), and
    in the redone stage 1 and in stage 2 its message is all zero bytes: its replica is the shared
    state, and its zero Delta in 4 bits would still count and halve host 0's. Both end on one
    model, whose fragment 1 is host 0's own replica to rounding (the only one left of the
    survivors' progress there). In fp32 messages (``bits`` 32) the empty one is fp32 zeros."""
    store = _master()
    epochs = Epochs(store, tmp_path, 3)
    epochs.leave({2}, "exited")
    h0, h1 = _hosts(worker, store, 3, (0, 1))
    assert h0["reported"] == (2, True) and h1["reported"] == (1, True)
    for h in (h0, h1):
        assert h["event"]["leader"] == 0 and h["event"]["behind"] == [1]
        assert len(h["rows"]) == 2  # stages 1 and 2
        assert h["rows"][0][0].any() and not any(gathered[1].any() for gathered in h["rows"])
        assert h["progress"] == 4
    for a, b in zip(h0["fragments"] + h0["global"], h1["fragments"] + h1["global"], strict=True):
        assert torch.equal(a, b)
    # fragment 1 ends at host 0's replica, to 4-bit rounding (its residual included: about a
    # quarter here); counting host 1's message would have left it halfway back to where its last
    # sync put it (0.5). (Fragment 2 landed at the start: host 0's replica is its theta.)
    moved = (h0["replica"][1] - h0["synced"][1]).norm()
    assert (h0["fragments"][1] - h0["replica"][1]).norm() < 0.35 * moved
