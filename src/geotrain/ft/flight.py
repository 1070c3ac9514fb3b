"""A message in flight at a regroup: what the membership layer reads of it, and what it sends.

SparseLoCo, CO2, Streaming DiLoCo and DeMo each keep a message whose collective lands later
(``sync.base.InFlight``). At a regroup every rank reports whether its message still flies and
whether its collective completed there (``flight_status``), the shape of what it would send
again (``resend_meta``, for a deferred joiner's empty part), and the result it last landed
(``landed_meta``); where the members behind lack only that result, at the leader's step or a
period behind it, the leader sends it and nothing else (``only_a_landing_behind``,
``a_landing_behind_the_leader``, ``send_landing``). ``ft/elastic.py`` decides from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from geotrain.comm.communicator import Communicator

if TYPE_CHECKING:
    from geotrain.ft.elastic import StepStatus


def flight_status(sync) -> bool | None:
    """None where no message of this worker's flies, else whether its collective completed here
    without error (``InFlight.arrived_intact``)."""
    flight = sync.in_flight
    return None if flight is None or not flight.flying else flight.arrived_intact()


def resend_meta(sync) -> tuple[list[int], str] | None:
    """The shape and dtype of the message this worker would send again at its landing (None:
    none in flight, or its collective's result is already here)."""
    flight = sync.in_flight
    saved = flight.saved() if flight is not None and flight.flying and not flight.primed else None
    return None if saved is None else (list(saved.shape), str(saved.dtype).removeprefix("torch."))


def landed_meta(sync) -> tuple[list[int], str, int] | None:
    """The shape and dtype of the last landed collective's result this worker holds, and the
    size of the group it was sent in (None: none kept)."""
    landed = sync.in_flight.last_landed if sync.in_flight is not None else None
    if landed is None or sync.in_flight.last_landed_size is None:
        return None
    return list(landed.shape), str(landed.dtype).removeprefix("torch."), sync.in_flight.last_landed_size


def only_a_landing_behind(statuses: list[StepStatus], behind: list[int], meta) -> bool:
    """Whether the members ``behind`` lack only the result of the collective in flight that the
    leader landed (its ``meta``): the same step, the same sync and stage, their wait failed where
    the leader's completed (the lost peer's last chunk reached it). Then that result is all they
    need, not the leader's whole state."""
    if not behind or meta is None or meta[2] >= 256:  # (a count per entry in a byte: SparseLoCo's)
        return False
    best = max(statuses)
    return best.landed and all(
        (s.committed, s.local_done, s.stage, s.landed) == (best.committed, best.local_done, best.stage, False)
        for s in (statuses[r] for r in behind)
    )


def a_landing_behind_the_leader(
    statuses: list[StepStatus], places: list[tuple], keeps: list[bool], behind: list[int], leader: int, meta
) -> list[int]:
    """The members ``behind`` (placed by message) that lack only the result of the message the
    leader landed last, though the leader has gone on past that landing (a whole period on,
    where the message lands at the next sync: it has launched its next one): each failed its
    wait for that landing at its sync (the lost peer's last chunk reached the leader, not it), a
    place before the leader's, and the leader keeps that result (``last_landed``, kept until its
    next landing) and is not itself to land a message kept at this regroup. That result is all
    each needs: its redo lands it and goes on from its own step. Any other member behind must be
    at the leader's place (short of the leader's step, the next message it puts on the wire the
    leader's): it needs nothing, as where all are at one place. None (an empty list) where any
    member behind is elsewhere, or none lacks a landing: the state is handed over."""
    if not behind or meta is None or meta[2] >= 256 or keeps[leader]:  # (the leader is no joiner)
        return []
    index, *rest = places[leader]
    lacking = [
        r
        for r in behind
        if statuses[r].local_done and not statuses[r].landed and places[r] == (index - 1, *rest)
    ]
    if not lacking or any(places[r] != places[leader] for r in behind if r not in lacking):
        return []
    return lacking


def send_landing(comm: Communicator, behind: list[int], leader: int, meta, sync) -> dict[str, Any]:
    """The leader sends the result of the collective it landed to the members ``behind``, whose
    message in flight takes it as landed (``InFlight.prime``): at their retry each lands it as if
    the collective had completed there, their own message in it, and goes on with its own state.
    A gather of sparse messages, where the state is a model's worth (SparseLoCo on ``mini``:
    about 1.2 MB against 44 MB)."""
    shape, dtype, _ = meta
    nbytes = 0
    if comm.rank == leader:  # through the CPU, as a hand-over is (gloo's point to point)
        landed = sync.in_flight.last_landed.detach().to("cpu").contiguous()
        comm.exchange([(landed, r, 0) for r in behind], [])
        nbytes = landed.numel() * landed.element_size()
    elif comm.rank in behind:
        buf = torch.empty(shape, dtype=getattr(torch, dtype))
        comm.exchange([], [(buf, leader, 0)])
        sync.in_flight.prime(buf.to(sync.device))
        nbytes = buf.numel() * buf.element_size()
    return {"handed_over_bytes": comm.max_scalars([float(nbytes)])[0], "stripes": {}, "resumed_bytes": 0}
