"""A hand-over: the members' state sent to a joiner, or to a survivor whose collective failed
where the leader's finished (``ft/elastic.py`` ``regroup``), and loaded there.

Each part of the state (model, algorithm state, and the optimizer where every worker's is the
same: ``ft/state.py`` ``handed_over``) is encoded by every member at the furthest step, and
goes in chunks (``chunk_cuts``: at least ``CHUNK_BYTES``, at most ``MAX_CHUNKS`` a part), dealt
in turn over the members that hold it bitwise equal, so that no single uplink carries it all.
What the receivers hold equal already (by digest: a LoRA base, a survivor's tensors the
leader's last sync did not change) is not sent, nor the trained parameters where the algorithm
rebuilds them from its state (SparseLoCo's anchor). The receiver checks each part's sha256 and,
once loaded, the parameters' digest against the leader's (or, where they are rebuilt, that of
what the members hold equal).

A hand-over cut short by a lost member is resumed: the receiver keeps the chunks that arrived
(``PartReceived``, held in ``Membership.received``), and the retry sends only those whose
sha256 differs from the leader's chunk at that place. Its transfers are posted a window at a
time and none after the cut (``comm/waits.py`` ``wait_transfers``, wherever a membership
watches the group): gloo sends a message only once its receive is posted, and a transfer
abandoned on a retired group would otherwise go on under the retry. Where the admission is
deferred, the members post their sends and train on (``defer``) while the joiner receives.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from geotrain.comm.communicator import Communicator
from geotrain.ft.state import (
    HANDED_OVER,
    HEADER_BYTES,
    CorruptSnapshot,
    capture,
    decode,
    encode,
    entry_digests,
    handed_over,
    leaf_digests,
    param_digest,
    sync_state_of,
    tensors_digest,
    with_leaves,
    without_leaves,
)

if TYPE_CHECKING:
    from geotrain.ft.elastic import StepStatus

CHUNK_BYTES = 64 * 1024  # the least a hand-over's chunk holds: what a cut costs the retry
MAX_CHUNKS = 256  # chunks per part at most (each a transfer of its own)


@functools.cache
def _empty_header() -> str:
    """The header of a part that holds nothing (``encode(None)``: a codec with no shared entry)."""
    return bytes(encode(None)[:HEADER_BYTES]).hex()


def chunk_cuts(size: int) -> list[int]:
    """Where a part of ``size`` bytes is cut into the chunks a hand-over sends."""
    chunk = max(CHUNK_BYTES, -(-size // MAX_CHUNKS))
    return [*range(0, size, chunk), size]


@dataclass
class PartReceived:
    """What a receiver has of one part of a hand-over: its buffer, and which chunks of it have
    arrived. The flags are set by the exchange's waiter threads, also after a lost member cut
    the hand-over short (the receives posted before it, between live peers, go on), and read
    again at the retry."""

    buffer: torch.Tensor
    cuts: list[int]
    flags: list[bool]

    @classmethod
    def resumed(cls, cuts: list[int], before: PartReceived | None, have: set[int]):
        """A fresh buffer for the part, with the chunks ``have`` (reported from ``before``)."""
        got = cls(torch.empty(cuts[-1], dtype=torch.uint8), cuts, [False] * (len(cuts) - 1))
        for i in sorted(have):
            got.chunk(i).copy_(before.chunk(i))
            got.flags[i] = True
        return got

    def chunk(self, i: int) -> torch.Tensor:
        return self.buffer[self.cuts[i] : self.cuts[i + 1]]

    def arrived(self) -> dict[int, str]:
        """The sha256 of each chunk that has arrived, by its index."""
        return {i: _sha(self.chunk(i)) for i, f in enumerate(list(self.flags)) if f}


def _sha(chunk: torch.Tensor) -> str:
    return hashlib.sha256(chunk.numpy()).hexdigest()


def chunk_digests(blob: memoryview) -> list[str]:
    """The sha256 of each chunk of an encoded part (``chunk_cuts``)."""
    payload = torch.frombuffer(blob, dtype=torch.uint8)
    cuts = chunk_cuts(len(payload))
    return [_sha(payload[cuts[i] : cuts[i + 1]]) for i in range(len(cuts) - 1)]


class _ChunkFlags:
    """The per-receive flags ``Communicator.exchange`` sets, each its chunk's."""

    def __init__(self, slots: list[tuple[PartReceived, int]]) -> None:
        self.slots = slots

    def __setitem__(self, j: int, value: bool) -> None:
        part, i = self.slots[j]
        part.flags[i] = value

    def __len__(self) -> int:
        return len(self.slots)


def hand_over(
    comm: Communicator,
    statuses: list[StepStatus],
    behind: list[int],
    model,
    optimizer,
    sync,
    from_state: bool,
    kept: dict[str, PartReceived] | None = None,
    leaf_parts: tuple[str, ...] = ("sync",),
    defer: bool = False,
    before_receiving: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], Any]:
    """The members ``behind`` (a joiner; a survivor whose collective failed where the leader's
    finished) receive the state of the members at the furthest status, and load it.

    Each part (model, optimizer, algorithm state) is encoded by every member at the furthest
    status; where several hold it bitwise equal (the parameters after a sync; everything under
    S-SGD) it comes in stripes from all of them at once, point to point, so no single uplink
    carries it all; otherwise from the leader alone. The receiver checks each part's sha256 and,
    once loaded, that its parameters hash to the leader's. A joiner gets the optimizer only where
    the algorithm keeps it equal on every worker (S-SGD, DDP); under the local methods each
    worker's inner optimizer is its own: a survivor keeps its own and a joiner starts a fresh one
    rather than wait for a copy of another's (at 100 Mbit/s, 7 s for ``mini``'s AdamW moments).
    Where the algorithm rebuilds an adopter's trainable parameters from its own state
    (``parameters_from_state``: SparseLoCo's anchor), the model part holds only the rest (frozen
    weights, buffers), and the check is of what the members hold equal (``shared_state``). Model
    entries every member behind holds bitwise equal to the leader's (by digest, gathered first:
    a LoRA base built from the same seed or checkpoint) are not sent at all.
    ``from_state``: the leader's ``parameters_from_state`` (DreamDDP's depends on its codec,
    which a joiner learns only from the state it receives).
    Each part goes in chunks (``chunk_cuts``), and a receiver keeps in ``kept`` (its
    ``Membership.received``) those that arrived before a lost member cut the hand-over short:
    at the retry, a chunk whose sha256 is that of the leader's chunk at its place is not sent
    again (all but the changed ones where the members stood still, most where they trained on
    under a deferred admission: the step in the state moves, the anchor not until the next
    sync). Under faults every 20 s a 10 s hand-over was cut short again and again, and each
    retry started from nothing.
    ``leaf_parts``: the parts whose tensors are compared one by one (by digest) with the
    receivers' (none where a joiner receives: its fresh state holds none of the members'; the
    optimizer only where it is handed over).
    ``defer``: the servers post their sends and return, the receivers wait as ever: an
    admission that does not stop the members (``regroup``).
    ``before_receiving``: called on a receiver once the hand-over's collectives are done, before
    it waits for the chunks (a deferred joiner's part of the members' landing goes out there).
    Returns bytes and stripes per part handed over and the bytes of it a receiver kept, and a
    server's sends where deferred (``PostedSends``; else None)."""
    best = max(statuses)
    up = [r for r, s in enumerate(statuses) if s == best]
    leader = up[0]
    # What every member behind holds bitwise equal to the leader already (a LoRA base built
    # from the same seed or checkpoint, buffers) stays out of the model part: for a large
    # frozen base, hours of a slow link.
    rebuilt = _trained(model) if from_state else set()  # never sent: not worth hashing
    kept = {} if kept is None else kept
    state = None
    if comm.rank in up or (comm.rank in behind and leaf_parts):
        try:
            state = capture(
                step=sync.step_count, model=model, optimizer=optimizer, sync=sync, generators={},
                progress={}, replicated=set(), copy=False,
            )  # fmt: skip
        except Exception:
            if comm.rank in up:
                raise
            # a receiver whose state does not even capture (DreamDDP landing its averages late
            # on the old group, say) holds nothing to compare: it receives every tensor
    own = None
    if comm.rank in (leader, *behind):  # what each holds, by entry of the model, by tensor of the rest
        leaves = {p: leaf_digests(state["parts"][p]) for p in leaf_parts} if state is not None else {}
        own = (entry_digests(model, rebuilt), leaves)
    has = {p: part.arrived() for p, part in kept.items()} if comm.rank in behind else {}
    digests, kept_by = zip(*comm.all_gather_object((own, has)), strict=True)
    at_leader, leaves_at_leader = digests[leader]
    held = {name for name, d in at_leader.items() if all(digests[r][0].get(name) == d for r in behind)}
    left_home = held | rebuilt  # the model entries not sent
    # Of the algorithm's state (and the optimizer's, where it is handed over) each tensor that
    # every member behind holds bitwise equal already stays out too: a survivor a step behind
    # the leader lacks only what the leader's last sync changed (Streaming DiLoCo: one
    # fragment's global parameters and momentum, where it took the whole state, 1.1 MB for
    # ``tiny``, 87 MB for ``mini``).
    held_leaves = {
        p: {
            path
            for path, d in leaves_at_leader.get(p, {}).items()
            if all(digests[r][1].get(p, {}).get(path) == d for r in behind)
        }
        for p in leaf_parts
    }
    blobs: dict[str, memoryview] = {}
    mine = None
    if comm.rank in up:
        state["parts"]["model"] = {k: v for k, v in state["parts"]["model"].items() if k not in left_home}
        for p in leaf_parts:
            state["parts"][p] = without_leaves(state["parts"][p], held_leaves[p])
        blobs = {p: encode(state["parts"][p]) for p in HANDED_OVER}  # every part: the leader's list
        # The frame's header holds the payload's length and sha256: equal headers, equal bytes.
        headers = {p: bytes(b[:HEADER_BYTES]).hex() for p, b in blobs.items()}
        # each chunk's sha256 (the leader's; the others serve the same bytes): what a receiver
        # kept of a hand-over cut short is matched chunk by chunk, not by the whole part, since
        # under a deferred admission the members have trained on (the step in the state moves)
        # while most of it (the anchor until the next sync) has not
        chunks_at = {p: chunk_digests(b) for p, b in blobs.items()} if comm.rank == leader else None
        mine = (
            headers,
            _check_digest(model, sync, from_state),
            "optimizer" in sync.replicated_parts(),
            chunks_at,
        )
    metas = comm.all_gather_object(mine)
    headers, digest, shared_optimizer, leader_chunks = metas[leader]
    parts = handed_over(shared_optimizer)
    sends, recvs, slots, stripes, total, turn = [], [], [], {}, 0, 0
    empty: list[str] = []  # parts with nothing in them (a codec with no shared entry): for the log
    resumed = dict.fromkeys(behind, 0)  # bytes each receiver kept from a hand-over cut short
    mine: dict[str, PartReceived] = {}
    for tag, part in enumerate(parts):
        servers = [r for r in up if metas[r][0][part] == headers[part]]
        size = HEADER_BYTES + int.from_bytes(bytes.fromhex(headers[part])[8:16], "little")
        cuts = chunk_cuts(size)
        stripes[part], total = len(servers), total + size
        if headers[part] == _empty_header():
            empty.append(part)
        payload = torch.frombuffer(blobs[part], dtype=torch.uint8) if comm.rank in servers else None
        for r in behind:  # every rank deals the chunks each receiver lacks the same way
            held_chunks = kept_by[r].get(part, {})
            have = {i for i, d in held_chunks.items() if i < len(cuts) - 1 and leader_chunks[part][i] == d}
            resumed[r] += sum(cuts[i + 1] - cuts[i] for i in have)
            if comm.rank == r:
                mine[part] = PartReceived.resumed(cuts, kept.get(part), have)
            for i in range(len(cuts) - 1):
                if i in have:
                    continue
                server, turn = servers[turn % len(servers)], turn + 1  # in turn, across parts too
                if comm.rank == r:
                    recvs.append((mine[part].chunk(i), server, tag * MAX_CHUNKS + i))
                    slots.append((mine[part], i))
                elif comm.rank == server:
                    sends.append((payload[cuts[i] : cuts[i + 1]], r, tag * MAX_CHUNKS + i))
    if comm.rank in behind:  # what arrives stays for a retry, whatever cuts this one short
        kept.clear()
        kept.update(mine)
    finish = None
    if defer and comm.rank not in behind:  # gloo sends it while this member trains on
        finish = comm.send_later(sends)
    else:
        if before_receiving is not None and comm.rank in behind:
            before_receiving()
        comm.exchange(sends, recvs, _ChunkFlags(slots))
    if comm.rank in behind:
        try:
            got = {}
            for p in parts:
                got[p] = decode(memoryview(mine[p].buffer.numpy()), f"the members' {p} state")
                if held_leaves.get(p):  # what it holds equal already, its own copy
                    got[p] = with_leaves(got[p], state["parts"][p])
        except Exception:
            kept.clear()  # not to be trusted again
            raise
        kept.clear()
        if defer:  # kept until it meets the members: a fault before makes it a joiner again, and
            kept.update(mine)  # its next hand-over sends only the chunks that changed since
        loaded = model.load_state_dict(got["model"], strict=False)
        # only what it holds already (or rebuilds from the state) may be missing, nothing unknown come
        odd = sorted(set(loaded.missing_keys) - left_home) + sorted(loaded.unexpected_keys)
        if odd:
            raise CorruptSnapshot(f"the members' model state does not fit this model: {odd[:3]}")
        if "optimizer" in got:
            optimizer.load_state_dict(got["optimizer"])
        sync.load_state_dict(sync_state_of(got))
        if _check_digest(model, sync, from_state) != digest:
            what = "state the members share" if from_state else "parameters"
            raise CorruptSnapshot(f"the {what} received differ from the leader's after loading")
        # after the check: Streaming DiLoCo's adopter restarts from theta, SparseLoCo's from its anchor
        sync.adopted_state()
    # (a receiver's own figure; the others report the most any receiver kept)
    own_kept = resumed.get(comm.rank, max(resumed.values(), default=0))
    handed = {"handed_over_bytes": total, "stripes": stripes, "empty_parts": empty, "resumed_bytes": own_kept}
    return handed, finish


def _trained(model) -> set[str]:
    """The names of the model's trained entries, each alias of a tied weight included."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _check_digest(model, sync, from_state: bool) -> str:
    """What a hand-over's receiver checks against the leader's once loaded: the parameters, or
    where the algorithm rebuilds them from its state, what the members hold equal."""
    return tensors_digest(sync.shared_state()) if from_state else param_digest(model)
