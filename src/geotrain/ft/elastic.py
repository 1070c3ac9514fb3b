"""Survivors go on: what a trainer does when its group loses a member (``--on-failure continue``).

The training loop catches ``MembershipChanged`` (or a collective's error, once the coordinator
confirms a new epoch) at whatever phase of step t it happened and calls :func:`regroup`:

1. wait for the newest epoch whose members are all ready, leave the old group, join the new one
   (``ft/membership.py``); the algorithm drops what was bound to the old group;
2. agree on a consistent point. Each survivor reports how far it got: ``committed`` (the last
   step it finished, synchronisation included), ``local_done`` (step t's optimizer step was
   applied but its synchronisation failed: a periodic method's sync boundary) and ``landed``
   (its message in flight has landed: that sync, or the end-of-run average, may have landed it
   before it failed). Nothing moves
   where that is consistent. Per-step methods all report the same step and redo it with the same
   batch (no survivor applied it: their collectives come before the optimizer step). Periodic
   methods (``sync_period() = H > 1``) run free between syncs, so survivors are at different
   local steps when a fault stops them; as long as all have completed the same number of
   collectives (every ``collective_period()`` steps: the syncs, and ``--site-H``'s site averages
   between them), each goes on from its own step: those whose averaging failed redo it
   (``retry_sync``) and the others meet it at that boundary from their own ``after_step``. A
   collective can finish on some survivors and fail on others (the lost peer had sent its last
   chunk; or a message in flight landed on one, which then failed its sync's next collective,
   while its wait failed on another or it was still before that sync: ``StepStatus.landed``,
   since a retry lands nothing twice); then the one that got
   furthest (the leader) sends its model and algorithm state (its optimizer too where every
   worker's is the same: S-SGD, DDP) to the others, who adopt it. Codec residuals and data
   streams stay with their owners;
3. the algorithm adapts to the new group (a new DDP wrapper; DreamDDP profiles and re-plans for
   the new worker count).

Joiners of the periodic methods with no collective between syncs (``defers_admission``) never
hold the members up for the state: where no sync failed, the members post the hand-over's
sends and train on to their next sync, where the joiners meet them; where a sync failed at its
boundary, the joiners stand in for their part of its redo (the leader's state's shapes, zeros,
left out of it) and receive the state once the redo is done (``admit_after_redo``), in the
same deferred way. Only where that next sync is past the run's end does a joiner take the state
before the redo, and every member wait for it.

What a failure costs: the failed collective's work (one step for per-step methods, one averaging
for periodic ones), the time to detect it, and the regroup. The global batch shrinks with the
group; the learning rate is left as it is and the token count follows the live workers.
A compressed message lost in the failed collective is lost from error feedback too (its residual
was updated when it was encoded): one step's compressed gradient, once.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from geotrain.comm.communicator import Communicator
from geotrain.compress.codec import shared_entries
from geotrain.ft.flight import (
    a_landing_behind_the_leader,
    flight_status,
    landed_meta,
    only_a_landing_behind,
    resend_meta,
    send_landing,
)
from geotrain.ft.handover import hand_over
from geotrain.ft.membership import Membership, NoStateHolder, RunFinished, retire, sync_boundary
from geotrain.ft.state import (
    clone_tree,
    map_leaves,
)


@functools.total_ordering
@dataclass(frozen=True)
class StepStatus:
    committed: int  # the last step finished on this worker, synchronisation included
    local_done: bool  # the step after it applied its optimizer step, and its sync failed
    # Its algorithm's message in flight has landed, none is left to land (False where it has
    # none: ``SyncAlgorithm.in_flight``). A sync that landed one and then failed does not land
    # it again in its retry, so a survivor that landed it is further than one whose wait failed,
    # though both failed the same step. Read live by ``regroup``: a redo that failed again, or
    # an adoption, has moved it.
    landed: bool = False
    # Inside an end-of-run average of several collectives in turn (Streaming DiLoCo's
    # fragments), how many it has completed (``SyncAlgorithm.final_progress``): survivors at
    # different stages would each redo their own. Read live by ``regroup`` too. It ranks before
    # ``landed``: a survivor a stage further has landed more, whatever its message now.
    stage: int = 0

    def _rank(self) -> tuple[int, bool, int, bool]:
        return (self.committed, self.local_done, self.stage, self.landed)

    def __lt__(self, other: StepStatus) -> bool:
        return self._rank() < other._rank()

    @property
    def done(self) -> int:
        """The last complete step once the failed sync (if any) is redone: training goes on after it."""
        return self.committed + int(self.local_done)


def catching_up(statuses: list[StepStatus], period: int, places: list | None = None) -> list[int]:
    """The ranks that must adopt the leader's state: none where periodic members (``period`` > 1,
    the collective period) have all completed the same collectives (each goes on from its own
    local step), otherwise every rank not at the furthest status (a joiner is at step -1, behind
    every sync). Landing a message in flight is a collective too: where one member landed it
    in the sync that failed and another did not (its wait failed, or it had not reached that
    sync), the first is further, and the others would send it again."""
    best = max(statuses)
    places = places if places is not None else [_place(s, period) for s in statuses]
    if period > 1 and len(set(places)) == 1:
        return []
    return [r for r, s in enumerate(statuses) if s != best]


def _place(status: StepStatus, period: int) -> tuple:
    """Where a survivor is among the collectives: the collective period it is in, whether its
    message in flight has landed, its stage. Survivors at the same place go on each from its own
    step."""
    return (status.committed // period, status.landed, status.stage)


def _places(
    statuses: list[StepStatus], flights: list[bool | None], period: int, by_message: bool
) -> tuple[list[tuple], list[bool]]:
    """Each rank's place for the regroup's agreement (``_place``), and whether its message in
    flight lands from what arrived (``InFlight.keep_arrived``). ``flights``: by rank, None where no message
    flies, else whether its collective completed here without error (``InFlight.arrived_intact``).

    ``by_message`` (every member's algorithm says ``places_by_message``: SparseLoCo, CO2): a
    survivor's place is the period whose message it puts on the wire first in the new group:
    its message in flight's, where that must be sent again, else the next sync's (which it
    launches there). A message in flight need not be sent again where its collective completed
    on every member holding it: each lands what arrived (``InFlight.keep_arrived``). So a member
    past a sync, its overlapped message in flight (the lost member never sent its part: it is
    sent again at its landing), and one short of that sync, the last period's message arrived
    whole (it launches that sync's message there), are at the same place, and each goes on from
    its own step, where one of them used to take the other's whole state. A joiner has a place
    of its own. (Where contributions are checked, a kept result's rows are the old group's: the
    check reads them as that group's, ``InFlight.rows_judged``.)"""
    if not by_message:
        return [_place(s, period) for s in statuses], [False] * len(statuses)
    holders: dict[int, list[bool]] = {}
    for s, arrived in zip(statuses, flights, strict=True):
        if s.committed >= 0 and arrived is not None:
            holders.setdefault(s.committed // period, []).append(arrived)
    kept = {i for i, arrived in holders.items() if all(arrived)}
    places: list[tuple] = []
    keeps: list[bool] = []
    for s, arrived in zip(statuses, flights, strict=True):
        i = s.committed // period
        flies = s.committed >= 0 and arrived is not None
        keeps.append(flies and i in kept)
        sent_again = flies and i not in kept
        places.append((i if sent_again else i + 1, s.stage) if s.committed >= 0 else ("joiner",))
    return places, keeps


def next_boundary(statuses: list[StepStatus], behind: list[int], period: int | list[int]) -> int:
    """The sync boundary every member heads for after a regroup, each from the step it goes on
    after (those ``behind`` from the leader's): where too few members pause together. One member
    that stopped exactly at a boundary while another is past it goes on to the next one too
    (it waits there for the others' sync). ``period``: one for all, or each rank's own (its
    ``sync_period``: under ``--H-schedule`` it depends on the step), those behind taking the
    leader's with its state."""
    best = max(statuses)
    periods = period if isinstance(period, list) else [period] * len(statuses)
    leader = periods[statuses.index(best)]
    return max(
        sync_boundary(best.done, leader) if r in behind else sync_boundary(s.done, periods[r])
        for r, s in enumerate(statuses)
    )


def held_copies(
    leaders: list[int | None], statuses: list[StepStatus], members: list[int], stands_in: bool = True
) -> set[int]:
    """The ranks whose state is a copy of a leader's for an average not yet redone (``leaders``:
    by rank, the host each copied, or None), and so are left out of it: all of them while that
    leader is a member (not a joiner that took its host's number), else all but the lowest
    rank, whose copy then stands for the leader, once. Not where the copy cannot stand in
    (``stands_in`` False: an adopter that started from the shared state, ``parameters_from_state``,
    holds none of the leader's progress): all of them, always."""
    present = {members[r] for r, s in enumerate(statuses) if s.committed >= 0 and leaders[r] is None}
    return _left_out(leaders, present, stands_in)


def _left_out(leaders: list[int | None], present: set[int], stands_in: bool) -> set[int]:
    """Of the ranks holding a copy of a leader's state (``leaders``: by rank, the host each
    copied, or None), those an average leaves out: every copy of a leader ``present`` (a member
    with its own state), all but the lowest rank's of one gone, or all where a copy cannot
    stand in."""
    out: set[int] = set()
    for host in {h for h in leaders if h is not None}:
        holders = [r for r, h in enumerate(leaders) if h == host]
        out |= set(holders if host in present or not stands_in else holders[1:])
    return out


def copies_at_the_end(events: list[dict[str, Any]], steps: int, stands_in: bool = True) -> set[int]:
    """The ranks (in the last regroup's order) left out of the end-of-run average of a run of
    ``steps``, after the regroups ``events``: those that adopted a leader's state in a regroup at
    the end (the leader was in that average, or done with it) train no step after it, so they hold
    a copy of its replica (or the shared state) and their message would count it twice, or a
    replica nobody trained. A regroup before the end is not counted: its adopters trained since.
    Kept through every regroup at the end (a second one inside the average too). Where the leader
    copied has left, one copy stands in for it where a copy can (``stands_in``, as
    :func:`held_copies`); never where adopters start from the shared state."""
    copied: dict[int, int] = {}  # host -> the leader whose state it took
    for event in events:
        if event["furthest"] >= steps:
            copied |= {h: event["leader"] for h in event["behind"]}
    if not events:
        return set()
    members = events[-1]["members"]
    leaders = [copied.get(h) for h in members]
    return _left_out(leaders, {h for h in members if h not in copied}, stands_in)


def owned_shards(host: int, hosts: int, members: list[int]) -> list[int]:
    """The data shards (one per first-epoch host) this host reads from: its own, and, dealt in
    turn over the members, those of hosts that have left. Every worker computes the same deal."""
    orphans = [s for s in range(hosts) if s not in members]
    mine = [host] if host in members else []
    return mine + [s for k, s in enumerate(orphans) if members[k % len(members)] == host]


@dataclass(frozen=True)
class _Zeros:
    """A tensor of the leader's state, by shape and dtype: what a joiner standing in for a redo
    fills with zeros (``_stand_in``)."""

    shape: tuple[int, ...]
    dtype: str


def _stand_in(comm: Communicator, sync, leader: int, joiners: list[int]) -> None:
    """The ``joiners`` take the leader's algorithm state with every tensor zero (its steps, its
    decisions, the shapes of its messages: a few KB, where the state is a model's worth), as an
    adopter that loaded it would hold it: so each makes the redone sync's collectives as the
    members do, with an empty message, left out of the average (``retry_sync``'s adopters).
    What it holds after is nothing; the state comes after the redo (``admit_after_redo``)."""
    skeleton = None
    if comm.rank == leader:
        state = sync.state_dict()
        state.pop("own", None)  # as a hand-over: each worker's own, never an adopter's
        # the codec's entries every worker holds equal go as they are (a few KB: counters and
        # low-rank factors; on the CPU, as every rank unpickles them): zero, ACP-SGD's turn
        # would send P where the members send Q
        shared = clone_tree(shared_entries(state.pop("codec", None)))
        skeleton = map_leaves(
            state,
            lambda v: (
                _Zeros(tuple(v.shape), str(v.dtype).removeprefix("torch.")) if torch.is_tensor(v) else v
            ),
        )
        if shared is not None:
            skeleton["codec_shared"] = shared
    skeleton = comm.all_gather_object(skeleton)[leader]
    if comm.rank in joiners:
        zeros = lambda v: torch.zeros(v.shape, dtype=getattr(torch, v.dtype), device=sync.device)  # noqa: E731
        sync.load_state_dict(map_leaves(skeleton, lambda v: zeros(v) if isinstance(v, _Zeros) else v))
        sync.adopted_state()


def admit_after_redo(
    membership: Membership,
    comm: Communicator,
    sync,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    done: int,
    joiners: list[int],
    from_state: bool,
) -> dict[str, Any]:
    """A regroup's ``hand_over_after``: the joiners (group ranks) that stood in for the sync
    redone at step ``done`` receive the members' state of that step, every member past it
    serving what it holds equal to the others; the members post their sends and train on
    (``membership.sending``, waited on where the joiners meet them), the joiners load it.
    Called by every member of the epoch once it has completed that sync (in the regroup's redo,
    or short of it, from its own step) and by the joiners. Returns the hand-over's figures."""
    statuses = [
        StepStatus(-1, False) if r in joiners else StepStatus(done, False) for r in range(comm.world_size)
    ]
    # A joiner took part in the redone sync's collective in flight (an overlapped gather): it
    # lands that one, not the leader's message that the state it loads holds to send again.
    flight = sync.in_flight
    live = flight.live() if comm.rank in joiners and flight is not None else None
    handed, sending = hand_over(
        comm, statuses, joiners, model, optimizer, sync, from_state, membership.received, (), defer=True
    )
    if comm.rank not in joiners:
        membership.sending = sending
    elif flight is not None:
        flight.take_live(live)
    return handed


class _Report(NamedTuple):
    """What each rank tells the others at a regroup (gathered): every rank takes the same
    decisions from all of them."""

    committed: int
    local_done: bool
    tokens: int
    collective_period: int
    sync_period: int  # its own: around a warm start's end the ranks' periods differ
    holds_copy: int | None  # whose state it holds a copy of for an average not yet redone
    landed: bool
    stage: int
    from_state: bool  # ``parameters_from_state``
    landed_meta: tuple[list[int], str, int] | None  # ``flight.landed_meta``
    shared_optimizer: bool
    defers: bool  # ``defers_admission``
    steps: int  # the run's last step
    flight: bool | None  # ``flight.flight_status``, where it places by message
    flight_meta: tuple[list[int], str] | None  # ``flight.resend_meta``: what it would send again
    # ``places_by_message``; not with ``--lr-scale auto``, whose exchange at every sync is a
    # blocking collective: a member that redoes a sync alone would pair it with another's message
    by_message: bool
    held: tuple[int, bool] | None  # a deferred joiner's loaded state: (committed, local_done)
    finished: bool  # the store says the run has finished

    def status(self, held: bool = False) -> StepStatus:
        committed, local_done = self.held if held else (self.committed, self.local_done)
        return StepStatus(committed, local_done, self.landed, self.stage)


def regroup(
    membership: Membership,
    comm: Communicator,
    sync,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    status: StepStatus,
    backend: str = "gloo",
    tokens: int = 0,
    previous: list[int] | None = None,
    adopted: Callable[[StepStatus, int], None] | None = None,
    steps: int = 0,
    held: StepStatus | None = None,
) -> dict[str, Any]:
    """Join the newest epoch and agree where training goes on. Returns the event for the summary:
    ``resume`` is where this member goes on from (the leader's status once it adopted the
    leader's state, else its own), ``tokens`` the token count that goes with it.
    A joiner comes with ``StepStatus(-1, False)``: behind everyone, it receives their state.
    ``previous``: the members before this regroup (a retried one has changed them already).
    ``adopted(status, tokens)`` is told as soon as this member has loaded the leader's state, so
    that a regroup retried after a later failure reports where this member now is.
    ``steps``: the run's last step (an admission is deferred only to a sync at or before it).
    ``held``: a joiner admitted deferred that has loaded the members' state and not met them yet
    comes as a joiner (``status`` -1: the members are past that state), with where that state
    stands: where no member is left, it goes on from there, and is the others' leader."""
    t0 = time.perf_counter()
    # What this worker's cut-short step changed of the state every worker holds equal (a codec's
    # turn, counts, factors) is undone first: the others were cut short elsewhere in it, and a
    # leader hands over the state of its last complete step.
    sync.roll_back()
    comm.forget_cut_verdicts()  # (the same for the norm check's verdicts: the step is judged again)
    if membership.sending is not None:  # a deferred hand-over's sends, on a group now left
        if not membership.sending.done():  # (gloo may still read their tensors)
            retire(membership.sending)
        membership.sending = None
    epoch, members = membership.next_epoch()
    before = membership.members if previous is None else previous
    t_join = time.perf_counter()
    membership.join(epoch, members, backend)
    comm.rebind(None)
    if sync.in_flight is not None:  # a result primed by a regroup that then failed: decided afresh
        sync.in_flight.unprime()
    # Every rank takes the same decisions below from all ranks' reports (of periods, the least:
    # the most careful). A copy of a leader's state held for an average not yet redone (it
    # adopted in a regroup whose redo then failed too) is left out of it while that leader is a
    # member.
    in_flight = sync.in_flight
    reports: list[_Report] = comm.all_gather_object(
        _Report(
            status.committed, status.local_done, tokens, sync.collective_period(), sync.sync_period(),
            membership.holds_copy, in_flight is not None and not in_flight.flying,
            sync.final_progress(), sync.parameters_from_state, landed_meta(sync),
            "optimizer" in sync.replicated_parts(), sync.defers_admission(), steps,
            flight_status(sync) if sync.places_by_message else None, resend_meta(sync),
            sync.places_by_message and sync.noise is None,
            (held.committed, held.local_done) if held is not None else None,
            membership.store().check(["finished"]),
        )
    )  # fmt: skip
    statuses = [r.status() for r in reports]
    # No member is left, but joiners admitted deferred hold the state the members handed them
    # (of a step the members went past, and whose progress since is lost with them): they go on
    # from it, the holder furthest on the others' leader, where every host used to restart from
    # the snapshots (older, and a restart of every process).
    # (whether the run has finished: one view for all, each rank's read of the store may differ)
    finished = any(r.finished for r in reports)
    revived = all(s.committed < 0 for s in statuses) and any(r.held is not None for r in reports)
    if revived and not finished:
        statuses = [r.status(held=r.held is not None) for r in reports]
    voters = [r for r, s in zip(reports, statuses, strict=True) if s.committed >= 0] or reports
    collective_period = min(r.collective_period for r in voters)
    sync_period = min(r.sync_period for r in voters)
    by_message = all(r.by_message for r in voters)
    places, keeps = _places(statuses, [r.flight for r in reports], collective_period, by_message)
    # members going on each from its own step in different periods (``quiet_through``)
    periods_in = {s.committed // collective_period for s in statuses if s.committed >= 0}
    straddle = by_message and len(periods_in) > 1
    if keeps[comm.rank]:
        sync.in_flight.keep_arrived()  # every member holding it has it: nothing is sent again
    best = max(statuses)
    leader = statuses.index(best)
    if best.committed < 0:  # only joiners are left: the members have finished, or were all lost
        if finished:
            raise RunFinished("the members left the run before this joiner could be admitted")
        raise NoStateHolder(
            "every member holding the training state was lost before this joiner could be admitted"
        )
    behind = catching_up(statuses, collective_period, places)
    # A regroup inside a deferred admission's period (the members at their own steps): where
    # the members have all completed the same syncs, only the joiners are behind, and they are
    # admitted deferred again, to the same sync, as the members train on from their own steps.
    joiners = [r for r, s in enumerate(statuses) if s.committed < 0]
    within = {place for place, s in zip(places, statuses, strict=True) if s.committed >= 0}
    lead = reports[leader]
    deferred_until = sync_boundary(best.done + 1, lead.sync_period)
    # The members' next sync, where joiners meet them, is at or before the run's last step, and
    # the algorithm has no collective before it: joiners need not hold the members up.
    defers = lead.defers and (not lead.steps or deferred_until <= lead.steps)
    consistent = bool(joiners) and collective_period > 1 and len(within) == 1
    deferrable = bool(joiners) and defers and not best.local_done
    # Or a sync failed on the furthest members, at its boundary, while joiners waited: each
    # joiner stands in for its part of the redo (the leader's state's shapes, zeros:
    # ``_stand_in``), left out of it, and receives the state once the redo is done, as a deferred
    # admission does, while the members train on (``admit_after_redo``); members short of the
    # boundary keep their own state and meet the redo from their own step, leaving out what it
    # leaves out (``left_out``). A hand-over before the redo held every member for a model's
    # worth of the slow link, and kills more frequent than that (SparseLoCo at 300 kbit/s, a kill
    # every 20 s) cut it again and again: the run stood still for minutes.
    redo_first = consistent and best.local_done and defers
    # Only where that next sync is past the run's end do the joiners adopt the leader's state
    # before the redo and take part in it (members short of the boundary still meet it).
    late = [r for r, s in enumerate(statuses) if s.committed >= 0 and not s.local_done]
    redo_met = best.local_done and late and lead.defers
    if redo_first:
        behind = []
    elif consistent and (deferrable or redo_met):
        behind = joiners
    from_state = lead.from_state  # the leader's: a joiner's fresh algorithm may differ
    stands_in = not from_state
    handed: dict[str, Any] = {"handed_over_bytes": 0, "stripes": {}, "resumed_bytes": 0}
    deferred: tuple[list[int], int] = ([], 0)  # joiners that join at the members' next sync, and it
    caught_up: list[int] = []
    # Where the redo lands it in this regroup (the sync that failed). Its rows are the old
    # group's: each reads its own by the rank it sent as (``InFlight.own_row``), and the norm
    # check reads them as that group's hosts (``rows_judged``), wherever its rank moved.
    meta = lead.landed_meta
    # (Those a place behind the leader get its last landing; members behind at its place, short
    # of its step, need nothing: ``a_landing_behind_the_leader``.)
    if best.local_done and only_a_landing_behind(statuses, behind, meta):
        lacking = behind
    else:
        lacking = (
            a_landing_behind_the_leader(statuses, places, keeps, behind, leader, meta) if by_message else []
        )
    if lacking:
        handed = send_landing(comm, lacking, leader, meta, sync)
        caught_up, behind = lacking, []  # each goes on with its own state, the landing's result primed
    standing_in = joiners if redo_first else []
    copies = frozenset(behind) | frozenset(standing_in)
    copies |= held_copies([r.holds_copy for r in reports], statuses, members, stands_in)
    # Whoever meets a redo from its own step leaves out what the redo leaves out: the joiners'
    # copies just made, or copies held from a regroup whose redo failed (a second fault while
    # the redo waited for the members short of the boundary).
    meeting = [r for r in late if r not in behind]
    left_out = [members[r] for r in sorted(copies)] if best.local_done and meeting and copies else []
    if comm.rank not in behind and comm.rank not in standing_in:  # chunks of a hand-over cut
        membership.received.clear()  # short it no longer needs
    if standing_in:
        _stand_in(comm, sync, leader, standing_in)
        if comm.rank in standing_in and adopted is not None:  # the state it held is zeros now: a
            adopted(status, tokens)  # retried regroup must not go on from it (``held``)
    adopting = [r for r in behind if r not in joiners]
    if adopting and comm.rank == leader:  # members whose own state cannot go on: why, for the log
        where = "; ".join(
            f"host {members[r]} after step {statuses[r].committed}"
            + (" (sync failed)" if statuses[r].local_done else "")
            + f" at {places[r]}"
            for r in range(len(members))
            if r not in joiners
        )
        print(
            f"geotrain: host {members[leader]}: hosts {[members[r] for r in adopting]} take its state "
            f"(collective period {collective_period}; {where})",
            file=sys.stderr,
            flush=True,
        )
    live: list = []  # a deferred joiner's part of the members' landing, sent before its hand-over
    if behind:
        fresh = any(r in joiners for r in behind)
        leaf_parts = () if fresh else ("sync", "optimizer") if lead.shared_optimizer else ("sync",)
        # Only joiners behind, no sync failed, under an algorithm with no collective before its
        # next sync (at or before the run's last step): the members train on while the joiners
        # receive, and meet them at that sync, where the joiners' part is left out.
        defer = deferrable and behind == joiners
        # A deferred joiner takes part in the members' landing of their message in flight (sent
        # again on this group) with an empty one. Sent before it waits for the state, not from
        # the loop once it holds it: the members would wait at that landing for the rest of its
        # hand-over (a model's worth of the slow link) instead of training on to their sync.
        resending = [
            r
            for r, report in enumerate(reports)
            if r not in joiners and report.flight is not None and not keeps[r] and report.flight_meta
        ]

        def send_empty() -> None:
            shape, dtype = reports[resending[0]].flight_meta
            sync.in_flight.launch_empty(shape, dtype, sync.device)
            live.append(sync.in_flight.live())  # kept across the state's load (``take_live``)

        # (Where contributions are checked too, the default among 3 workers or more. Not a mean's
        # under the check, whose screen is a collective the joiner would wait in until the
        # members' landing, its hand-over not begun: at a landing at the sync itself, tau = H,
        # the members would then wait at that sync for all of it.)
        blocking = sync.in_flight is not None and sync.in_flight.op == "mean" and comm.checking
        early = send_empty if defer and resending and comm.rank in joiners and not blocking else None
        handed, membership.sending = hand_over(
            comm, statuses, behind, model, optimizer, sync, from_state, membership.received, leaf_parts,
            defer, early,
        )  # fmt: skip
        if defer:
            deferred = ([members[r] for r in behind], deferred_until)
        if comm.rank in behind and adopted is not None and not defer:  # (deferred: until it meets them)
            adopted(best, lead.tokens)
        if comm.rank in behind and best.local_done:
            membership.holds_copy = members[leader]  # until the average below completes
    # behind none: each at its own step (a joiner standing in: at the leader's, to redo it)
    mine = best if comm.rank in behind or comm.rank in standing_in else statuses[comm.rank]
    # Where joiners are admitted: each member's next boundary, by its own period (which under
    # --H-schedule depends on its step; the least of them would name a step that is none).
    periods = [
        r.sync_period if s.committed >= 0 else sync_period for r, s in zip(reports, statuses, strict=True)
    ]
    boundary = next_boundary(statuses, behind, periods)
    membership.going_on_after(mine.done)
    t_handed = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    sync.rebind()
    if live:  # (after the rebind, which takes what flies for the old group's)
        sync.in_flight.take_live(live[0])
    if sync.noise is not None:  # --lr-scale auto: one measure everywhere, whatever a failure cut short
        sync.noise.agree(comm)
    t_redo = time.perf_counter()
    if mine.local_done:
        # The failed averaging itself, on the new group: link time, not overhead. Members that
        # had not reached this boundary meet it from their own after_step. Those that adopted
        # the leader's state redo it too (they are at its step), but hold its contribution: in
        # the average they weigh nothing, or the leader would count twice.
        sync.retry_sync(adopters=copies)
    membership.holds_copy = None
    membership.newcomer = False  # its site, if measured, is the members' now
    sync.settle()  # where it goes on from: the redone sync landed, or its step not begun
    if standing_in:
        deferred = ([members[r] for r in standing_in], deferred_until)
        if comm.rank in standing_in:  # past the redone sync, once it has the state (not before)
            mine = StepStatus(best.done, False)
    return {
        "epoch": epoch,
        "members": members,
        "resume": mine,
        "joined": [m for m in members if m not in before] if before else [membership.host],
        "behind": [members[r] for r in behind],
        "caught_up": [members[r] for r in caught_up],
        "leader": members[leader],
        "furthest": best.done,  # collectives up to it (an evaluation) are behind every member
        # Evaluations (and a snapshot's agreement to ship) are collectives on the group too: none
        # up to the step before the next sync where members placed by message are in different
        # periods (one past a sync, its message in flight, another short of it: an evaluation
        # between would pair with a message), none up to the furthest step elsewhere.
        "quiet_through": deferred_until - 1 if straddle else best.done,
        "boundary": boundary,
        "deferred": deferred[0],  # they skip to it, and their part of its average is left out
        "deferred_until": deferred[1],
        # members short of the redone sync meet it at that step with these hosts' part left out
        "left_out": left_out,
        "left_out_until": best.done if left_out else 0,
        # the joiners receive the state after the redone sync, ``admit_after_redo``: at once where
        # at that sync, from the training loop where short of it (once it has met it)
        "hand_over_after": best.done if standing_in else 0,
        "from_state": from_state,
        "tokens": lead.tokens if comm.rank in behind or comm.rank in standing_in else tokens,
        **handed,
        "wait_s": round(t_join - t0, 3),
        "hand_over_s": round(t_handed - t_join, 3),
        "regroup_s": round(t_redo - t0, 3),  # to the new group, agreed and adapted
        "redo_sync_s": round(time.perf_counter() - t_redo, 3),
    }
