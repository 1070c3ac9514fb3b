"""Two owners per shard (``int8``, ``int4``, ``sign`` with ``owners=2``): which owner is wrong.

In the quantised codecs' second phase worker j averages shard j of every contribution,
re-quantises it with error feedback of its own and all-gathers it (``compress.quantize``). With
``owners=2`` worker j + offset computes shard j too, from the same rows, and every worker
compares the two copies' bytes: a shard whose copies differ (a dispute) is left out of that
average everywhere. One pair cannot say which of its two is wrong. This module keeps what can:

- **Digests.** Each copy goes out with a 16-byte BLAKE3 digest of what it was computed from
  (the rows received, with their in-band norms, and the verdict on which contributions were
  kept). Where the two digests agree, one owner spoiled its copy (a *spoiled copy*); where they
  differ, the inputs differed on the way in (a sender sent the two owners different rows or
  norms, or an owner misreports them), and nobody is blamed: otherwise a hostile sender could
  have any honest owner blamed.
- **Moving second owners.** After a message with a spoiled copy, every shard's second owner moves
  on by one (``offset``: 1, 2, ..., N - 1, then 1 again), so a worker that keeps spoiling what it
  computes disputes with a different worker next time, while each of those disputes with it
  alone (``blame_disputes``). Both owners of every shard restart their error feedback with the
  move (the new second owner holds none of it): one message's rounding lost, once per such
  message. A dispute over differing inputs restarts only that shard's feedback, at its owners.
- **Stamps.** Every copy also carries its sender's ``(offset, messages)``, the owners' state the
  message was sent under. Workers whose states differ (a joiner's or a rebuilt host's empty
  state, a member whose last message failed) would roll their rows by different offsets, and
  the second copies would mean nothing: where the stamps are not all equal, the stamp a strict
  majority sent decides, a shard is left out where its copies differ or either owner sent under
  another stamp (every shard, with no majority), nobody is blamed, and every worker starts the
  owners' state again (``judge_copies``). An honest worker's stamp differs from the majority's
  at most once per stream in a membership epoch (each of those causes comes with a new epoch, or
  is the epoch's first message); a worker whose stamp differs again in the same epoch (a
  *stray*) is counted as rejected at each such message (``Communicator.count_strays``, whose
  record a regroup begins again), so ``--max-rejections`` drops one that
  sends false stamps rather than let it restart everyone's error feedback at every message. In a
  group of two no stamp has a strict majority, and nobody can be counted.

What this cannot do: an owner that spoils its copy *and* misreports its digest reads as a
dispute over inputs, and is never blamed (its shard is left out every time).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from geotrain.comm.digest import bytes_digest

# a copy's tail on the wire: the digest of its inputs, then its sender's stamp
DIGEST_BYTES = 16  # 128 bits: a collision costs a hostile sender about 2^64 hashes
STAMP_BYTES = 8
TAIL_BYTES = DIGEST_BYTES + STAMP_BYTES
# clean messages running after which who disputed with whom is forgotten
FORGET_AFTER = 16


def digest(rows: torch.Tensor, kept: list[bool] | None) -> torch.Tensor:
    """A collision-resistant digest (uint8, on ``rows``' device) of the rows a copy is computed
    from (uint8, as received, in-band norms included) and of the verdict's kept contributions,
    which a sender that sends two owners different norms could make differ."""
    h = bytes_digest(rows, DIGEST_BYTES, extra=bytes(kept) if kept is not None else b"-")
    return torch.frombuffer(bytearray(h), dtype=torch.uint8).to(rows.device)


def read_stamp(state: dict, world: int) -> tuple[int, int]:
    """``(offset, messages)`` of a stream's owners' state: shard j's second owner is worker
    j + offset; messages since the state began. (1, 0) where there is none, or where the group
    is now too small for the offset (every member alike: the same group)."""
    stamp = state.get("second_stamp")
    if stamp is None:
        return 1, 0
    offset, count = int(stamp[0]), int(stamp[1])
    if offset >= world:
        restart(state)
        return 1, 0
    return offset, count


def stamp_bytes(offset: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([offset, count], dtype=torch.int32).view(torch.uint8).to(device)


def restart(state: dict) -> None:
    """The owners' state begun again: second owners at worker j + 1, nobody's disputes
    remembered, both shard residuals dropped (the pairs agree again from the next message)."""
    for name in ("second_stamp", "dispute_partners", "owners_quiet", "server_residual", "second_residual"):
        state.pop(name, None)


@dataclass
class Copies:
    """A message's gathered copies, judged from the gathered bytes alone (so every worker
    judges them alike): ``first`` and ``second`` (row j: shard j's copy from its owner, and from
    its second owner, tails cut off), under the stamp most workers sent (``offset``;
    ``in_step``: every worker sent under it). ``disputed``: the shards left out; in step, the
    copies that differ (``Communicator.compare_shards`` fills it), with ``same_inputs`` saying
    which were computed from the same inputs. ``strays``: the workers that sent under another
    stamp than a strict majority's (none without one: then nobody can say who is out of step)."""

    first: torch.Tensor
    second: torch.Tensor
    offset: int
    in_step: bool
    same_inputs: list[bool]
    disputed: list[int] = field(default_factory=list)
    strays: list[int] = field(default_factory=list)

    @property
    def spoiled(self) -> list[int]:
        """The disputed shards whose two owners computed from the same inputs."""
        return [j for j in self.disputed if self.same_inputs[j]] if self.in_step else []


def judge_copies(first: torch.Tensor, second: torch.Tensor) -> Copies:
    """``first``, ``second``: the all-gathered halves (row r: worker r's own shard's copy, and
    its copy of the shard it holds second, each with its tail). Out of step (the stamps differ:
    a joiner, a rebuilt host, a message some finished and some did not), the stamp a strict
    majority sent decides the offset, and a shard is left out where its copies differ or either
    owner sent under another stamp; with no majority, every shard is left out. Nobody's copy is
    taken unchecked, so a worker that sends false stamps loses the shards it owns, no more."""
    world = first.shape[0]
    stamps = [bytes(r) for r in first[:, -STAMP_BYTES:].tolist()]
    common = max(set(stamps), key=stamps.count)
    majority = 2 * stamps.count(common) > world
    offset = int(torch.frombuffer(bytearray(common), dtype=torch.int32)[0]) if majority else 1
    offset = offset if 0 < offset < world else 1  # a false stamp must not roll a shard onto its owner
    second = second.roll(-offset, dims=0)
    ends = slice(-TAIL_BYTES, -STAMP_BYTES)
    same_inputs = (first[:, ends] == second[:, ends]).all(dim=1).tolist()
    first, second = first[:, :-TAIL_BYTES], second[:, :-TAIL_BYTES]
    in_step = majority and stamps.count(common) == world
    copies = Copies(first, second, offset, in_step, same_inputs)
    if majority:
        copies.strays = [r for r in range(world) if stamps[r] != common]
    if not in_step:
        differ = (first != second).any(dim=1).tolist()
        copies.disputed = [
            j
            for j in range(world)
            if not majority or differ[j] or stamps[j] != common or stamps[(j + offset) % world] != common
        ]
    return copies


def blame_disputes(partners: torch.Tensor, pairs: list[tuple[int, int]]) -> list[int]:
    """Which owners a run of spoiled copies points at.

    ``partners`` (N x N, bool): who has disputed with whom over a stream's consecutive messages
    with spoiled copies; ``pairs``: this message's, added to it in place. A worker that spoils
    what it computes disputes with every honest worker that computes the same shard, and after
    each such message the second owners move on, so over two messages it has disputed with two
    workers each of whom disputed with it alone. Returned: the ranks in this message's pairs
    with two or more such partners, where they are fewer than half the group. Two spoilers side
    by side hide each other (their partners dispute with both) rather than have an honest worker
    blamed; a group of two blames nobody (its pair never changes)."""
    for a, b in pairs:
        partners[a, b] = partners[b, a] = True
    alone = partners.sum(dim=1) == 1  # disputed with one worker only
    named = sorted({r for pair in pairs for r in pair})
    blamed = [r for r in named if int((partners[r] & alone).sum()) >= 2]
    return blamed if 2 * len(blamed) < partners.shape[0] else []


def settle(comm, state: dict, copies: Copies, count: int, stream: Any = None) -> None:
    """After a message with two owners per shard, on every worker alike (judged from the same
    gathered bytes): the owners' state for the next message (module docstring). Who disputed
    with whom is kept over the clean messages between spoiled copies (honest owners never
    produce one, so a worker that spoils every other message is still found), and forgotten
    after ``FORGET_AFTER`` clean messages running, so that rare honest faults far apart do not
    add up to a blame."""
    world, rank, offset = comm.world_size, comm.rank, copies.offset
    if not copies.in_step:
        comm.count_strays(stream, copies.strays)
        restart(state)
        if rank == 0:
            print(
                "geotrain: the workers held different owners' state for an average (a joiner, a host "
                f"rebuilt, a message that failed): {len(copies.disputed)} shard(s) left out this once, "
                "nobody blamed, and every shard's owners start again",
                file=sys.stderr,
                flush=True,
            )
        return
    count = (count + 1) % 2**31
    spoiled = copies.spoiled
    for j in copies.disputed:
        if j not in spoiled:  # inputs that differed: that shard's owners restart its feedback
            if j == rank:
                state.pop("server_residual", None)
            if j == (rank - offset) % world:
                state.pop("second_residual", None)
    quiet = int(state.get("owners_quiet", torch.tensor(0)))
    if not spoiled:
        quiet += 1
        if quiet >= FORGET_AFTER:
            state.pop("dispute_partners", None)
    else:
        quiet = 0
        partners = state.get("dispute_partners")
        if partners is None or partners.shape[0] != world:
            partners = torch.zeros(world, world, dtype=torch.bool)
        for r in blame_disputes(partners, [(j, (j + offset) % world) for j in spoiled]):
            comm.blame_owner(r, sorted(int(p) for p in partners[r].nonzero().flatten()))
        state["dispute_partners"] = partners
        if world > 2:  # the second owners move on, and every shard's feedback restarts
            offset = offset % (world - 1) + 1
            state.pop("server_residual", None)
            state.pop("second_residual", None)
        else:
            for j in spoiled:
                if j == rank:
                    state.pop("server_residual", None)
                if j == (rank - offset) % world:
                    state.pop("second_residual", None)
    state["owners_quiet"] = torch.tensor(quiet)
    state["second_stamp"] = torch.tensor([offset, count], dtype=torch.int32)
