"""Survivors go on: what a trainer does when its group loses a member (``--on-failure continue``).

The training loop catches ``MembershipChanged`` (or a collective's error, once the coordinator
confirms a new epoch) at whatever phase of step t it happened and calls :func:`regroup`:

1. wait for the newest epoch whose members are all ready, leave the old group, join the new one
   (``ft/membership.py``); the algorithm drops what was bound to the old group;
2. agree on a consistent point. Each survivor reports how far it got: ``committed`` (the last
   step it finished, synchronisation included) and ``local_done`` (step t's optimizer step was
   applied but its synchronisation failed: a periodic method's sync boundary). Usually all report
   the same, and nothing moves: per-step methods redo step t with the same batch (no survivor
   applied it: their collectives come before the optimizer step), periodic methods redo only the
   failed averaging among the survivors, keeping every survivor's local progress. A collective
   can finish on some survivors and fail on others (the lost peer had sent its last chunk); then
   the one that got furthest (the leader) sends its model, optimizer and algorithm state to the
   others, who adopt it. Codec residuals and data streams stay with their owners;
3. the algorithm adapts to the new group (a new DDP wrapper; DreamDDP profiles and re-plans for
   the new worker count).

What a failure costs: the failed collective's work (one step for per-step methods, one averaging
for periodic ones), the time to detect it, and the regroup. The global batch shrinks with the
group; the learning rate is left as it is and the token count follows the live workers.
A compressed message lost in the failed collective is lost from error feedback too (its residual
was updated when it was encoded): one step's compressed gradient, once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from geotrain.comm.communicator import Communicator
from geotrain.ft.membership import Membership
from geotrain.ft.state import capture, decode, encode


@dataclass(frozen=True, order=True)
class StepStatus:
    committed: int  # the last step finished on this worker, synchronisation included
    local_done: bool  # the step after it applied its optimizer step, and its sync failed

    @property
    def done(self) -> int:
        """The last complete step once the failed sync (if any) is redone: training goes on after it."""
        return self.committed + int(self.local_done)


def owned_shards(host: int, hosts: int, members: list[int]) -> list[int]:
    """The data shards (one per first-epoch host) this host reads from: its own, and, dealt in
    turn over the members, those of hosts that have left. Every worker computes the same deal."""
    orphans = [s for s in range(hosts) if s not in members]
    mine = [host] if host in members else []
    return mine + [s for k, s in enumerate(orphans) if members[k % len(members)] == host]


def _adopt(comm: Communicator, leader: int, model, optimizer, sync) -> int:
    """Copy the leader's model, optimizer and algorithm state to every member; returns bytes."""
    blob = None
    if comm.rank == leader:
        state = capture(
            step=sync.step_count, model=model, optimizer=optimizer, sync=sync, generators={},
            progress={}, replicated=set(), copy=False,
        )  # fmt: skip
        blob = torch.frombuffer(bytearray(encode(state)), dtype=torch.uint8)
    size = torch.tensor([blob.numel() if blob is not None else 0], dtype=torch.int64)
    comm.broadcast(size, src=leader)
    if blob is None:
        blob = torch.empty(int(size.item()), dtype=torch.uint8)
    comm.broadcast(blob, src=leader)
    if comm.rank != leader:
        parts = decode(blob.numpy().tobytes(), "the leader's state")["parts"]
        model.load_state_dict(parts["model"])
        optimizer.load_state_dict(parts["optimizer"])
        sync.load_state_dict(dict(parts["sync"]))  # not its codec: residuals stay with their owner
    return int(size.item())


def regroup(
    membership: Membership,
    comm: Communicator,
    sync,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    status: StepStatus,
    backend: str = "gloo",
) -> dict[str, Any]:
    """Join the newest epoch and agree where training goes on. Returns the event for the summary:
    ``resume`` is the agreed status (every member is now at it)."""
    t0 = time.perf_counter()
    epoch, members = membership.next_epoch()
    t_join = time.perf_counter()
    membership.join(epoch, members, backend)
    comm.rebind(None)
    statuses = [StepStatus(*s) for s in comm.all_gather_object((status.committed, status.local_done))]
    best = max(statuses)
    leader = statuses.index(best)
    adopted_bytes = 0
    if any(s != best for s in statuses):
        adopted_bytes = _adopt(comm, leader, model, optimizer, sync)
    optimizer.zero_grad(set_to_none=True)
    sync.rebind()
    t_redo = time.perf_counter()
    if best.local_done:
        sync.retry_sync()  # the failed averaging itself, on the new group: link time, not overhead
    return {
        "epoch": epoch,
        "members": members,
        "resume": best,
        "behind": [m for m, s in zip(members, statuses, strict=True) if s != best],
        "leader": members[leader],
        "adopted_bytes": adopted_bytes,
        "wait_s": round(t_join - t0, 3),
        "regroup_s": round(t_redo - t0, 3),  # to the new group, agreed and adapted
        "redo_sync_s": round(time.perf_counter() - t_redo, 3),
    }
