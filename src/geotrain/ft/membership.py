"""Membership epochs: how the survivors of a failure form a new process group and go on.

``--on-failure continue`` (the default). The coordinator (``launch/coordinator.py``, a process
that is not a trainer) owns the membership: when a host goes silent (its heartbeat stops) or its
trainer exits with an error (the launcher's "deathrattle"), it publishes epoch e+1 and its members
in its store (torch's ``TCPStore``)::

    epoch            a counter: the newest epoch published
    members/{e}      the hosts of epoch e, e.g. "0,2,3"
    ready/{e}/{h}    set by each member of epoch e once it has left the old group

Each trainer learns of a new epoch within a tenth of a second (its heartbeat thread reads the
counter), abandons the collective it is waiting for (the Communicator polls, so a frozen peer
that sends no reset cannot hold it), waits until every member of the newest epoch is ready,
destroys its old default group without using it again, and joins a fresh gloo group of the new
members on the store prefix ``geotrain/epoch{e}``. Ranks follow the order of host ids, so rank 0
of an epoch is its lowest surviving host: losing the first epoch's rank 0 (whose torchrun hosted
the first rendezvous) loses nothing, because no epoch after the first uses that store.

Only public torch APIs: ``TCPStore``, ``PrefixStore``, ``destroy_process_group`` and
``init_process_group(store=...)``. torchft's reconfigurable process groups do the same with
private ones and guard only all-reduce; ours guard every collective the Communicator issues.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.05

# Objects bound to an abandoned group (a DDP wrapper whose reducer holds it). Freeing the last
# reference to a gloo group destroys it, and that joins its threads: one stuck receiving from a
# peer whose link is down never returns, and the join would hold the GIL, silencing even this
# trainer's heartbeat. So they are kept, and a trainer that kept any leaves with ``os._exit``.
RETIRED: list = []


def retire(obj) -> None:
    if obj is not None:
        RETIRED.append(obj)


class MembershipChanged(RuntimeError):
    """The group this collective ran on has lost a member: abandon it and regroup."""


class Excluded(RuntimeError):
    """This host is not a member of the newest epoch (it was declared failed)."""


def parse_members(text: str) -> list[int]:
    return [int(h) for h in text.split(",") if h != ""]


class Membership:
    """A trainer's view of the epochs. ``changed()`` is cheap (a field the heartbeat thread
    updates) and is what the Communicator polls while it waits for a collective."""

    def __init__(self, addr: str, port: int, host: int, members: list[int], timeout_s: float) -> None:
        self.host = host
        self.epoch = 0
        self.members = list(members)
        self.timeout_s = timeout_s
        self.published = 0  # the newest epoch the heartbeat thread has seen
        self._where = (addr, port)
        self._store = None

    def store(self):
        """The main thread's client (the heartbeat thread has its own). Reconnects after the
        coordinator restarts on its port."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if self._store is None:
                    self._store = dist.TCPStore(
                        *self._where, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
                    )
                self._store.add("epoch", 0)  # a round trip: is it still there?
                return self._store
            except Exception:
                self._store = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def changed(self) -> bool:
        return self.published > self.epoch

    def wait_published(self, timeout_s: float) -> bool:
        """After a collective failed on its own: is a new epoch coming? (False: the error was
        not a lost member, and is the caller's to raise.)"""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.changed() or self._newest() > self.epoch:
                return True
            time.sleep(POLL_S)
        return False

    def _newest(self) -> int:
        return int(self.store().add("epoch", 0))

    def next_epoch(self) -> tuple[int, list[int]]:
        """The newest epoch once all its members are ready to form it: hosts that fail while the
        others wait make the coordinator publish yet another epoch, which is taken instead."""
        store = self.store()
        announced = -1
        deadline = time.monotonic() + self.timeout_s
        while True:
            epoch = self._newest()
            if epoch <= self.epoch:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no epoch after {self.epoch} was published in {self.timeout_s:.0f} s")
                time.sleep(POLL_S)
                continue
            members = parse_members(store.get(f"members/{epoch}").decode())
            if self.host not in members:
                raise Excluded(
                    f"host {self.host} is not in epoch {epoch} ({members}): it was declared failed"
                )
            if announced != epoch:
                store.set(f"ready/{epoch}/{self.host}", "1")
                announced = epoch
            if store.check([f"ready/{epoch}/{h}" for h in members]):
                return epoch, members
            if time.monotonic() > deadline:
                raise TimeoutError(f"members of epoch {epoch} ({members}) did not all get ready")
            time.sleep(POLL_S)

    def join(self, epoch: int, members: list[int], backend: str = "gloo") -> None:
        """Leave the old default group without a word to it and form the new one."""
        gc.collect()  # pending works and DDP reducers of the old group go first
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"geotrain/epoch{epoch}", self.store()),
            rank=members.index(self.host),
            world_size=len(members),
            timeout=timedelta(seconds=self.timeout_s),
        )
        self.epoch, self.members = epoch, list(members)
        self.published = max(self.published, epoch)
