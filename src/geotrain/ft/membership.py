"""Membership epochs: how the survivors of a failure form a new process group and go on.

``--on-failure continue`` (the default). The coordinator (``launch/coordinator.py``, a process
that is not a trainer) owns the membership: when a host goes silent (its heartbeat stops) or its
trainer exits with an error (the launcher's "deathrattle"), it publishes epoch e+1 and its members
in its store (torch's ``TCPStore``)::

    epoch            a counter: the newest epoch published
    members/{e}      the hosts of epoch e, e.g. "0,2,3" (joiners last: never rank 0)
    kind/{e}         "leave" (members were lost) or "join" (a joiner is admitted)
    ready/{e}/{h}    set by each member of epoch e once it has left the old group
    join/{h}         a joiner's request to be admitted (the coordinator takes it)
    at/{e}/{h}       the step after which member h of epoch e goes to the next (a join)
    finished         set when the first member leaves its training loop: joiners stop waiting
    spares           the backup pool (``launch/coordinator.Pool``): spares registered so far;
                     spare/{i}, poolhb/{i}, assign/{i}, claim/{i} and placed/{h} are its keys

Each trainer learns of a new epoch within a tenth of a second (its heartbeat thread reads the
counter), abandons the collective it is waiting for (the Communicator polls, so a frozen peer
that sends no reset cannot hold it), waits until every member of the newest epoch is ready,
destroys its old default group without using it again, and joins a fresh gloo group of the new
members on the store prefix ``geotrain/epoch{e}`` (on a ``FormationStore``: a formation a newer
epoch has doomed gives up at once). Ranks follow the coordinator's list of members, survivors in
their order and joiners last, so rank 0 of an epoch is its longest-serving survivor: losing the
first epoch's rank 0 (whose torchrun hosted the first rendezvous) loses nothing, because no epoch
after the first uses that store.

A *join* epoch interrupts nothing: the group in use is healthy. The members agree on the step
after which they admit the joiner, the next sync boundary none of them has passed: each posts the
boundary it has committed to (the end of the period it is in, or the one it just finished, posted
by whichever thread sees the epoch first) and all go on to the largest. There they regroup, and
the joiner receives the state of those at that step (``ft/elastic.py``). A joiner waits meanwhile
in a world of one of its own; its rank in the new epoch comes after every survivor's.

Only public torch APIs: ``TCPStore``, ``PrefixStore``, ``destroy_process_group`` and
``init_process_group(store=...)``. torchft's reconfigurable process groups do the same with
private ones and guard only all-reduce; ours guard every collective the Communicator issues.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
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


FORMATION_S = 60.0  # at most this long to make a group in a regroup: a few connects, not a collective's bytes


class FormationStore(dist.Store):
    """The store an epoch's groups form on (``Membership.join``): ``inner`` with waits that give
    up within ``bound_s`` and at once where ``abandon()`` says so (a newer epoch has lost members:
    the one forming waits for a peer that is gone, or for one that will leave it for the newer).
    A group's formation waits here for each peer's address, so a member killed between saying it
    was ready and posting its address held the others for the whole bound, and faults a few
    seconds apart outpaced every formation (a soak with a kill every 20 s stalled).

    Waits poll (``POLL_S``): the store's own blocking wait could not be cut short. Each wait
    has the whole bound. What this cannot cut short is gloo's connect to a peer that posted its
    address and then died, which gives up after about five times gloo's timeout (measured on
    torch 2.13: 2 s -> 10 s, 10 s -> 51 s; at the 60 s bound, about 5 minutes). That needs a
    death in the second between posting and connecting; a shorter gloo timeout would also fail a
    healthy formation whose SYNs a shaped link's full queue drops, and a formation that fails
    with no member lost ends the run."""

    def __init__(self, inner, abandon: Callable[[], bool], bound_s: float = FORMATION_S) -> None:
        super().__init__()
        self.inner, self.abandon, self.bound_s = inner, abandon, bound_s
        self._clones: list[FormationStore] = []  # torch holds the C++ side; Python must hold these

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        # ``timeout`` (gloo's: the bound, or the collective timeout where that is shorter) is
        # not the store's: its waits keep the bound, and give up early only by ``abandon``
        deadline = time.monotonic() + self.bound_s
        while not self.inner.check(keys):
            if self.abandon():
                raise MembershipChanged(
                    f"a newer epoch lost members while this group formed (waiting for {keys})"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"a group did not form: wait timeout after {self.bound_s:.0f} s, keys: {keys}"
                )
            time.sleep(POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def clone(self) -> FormationStore:
        twin = FormationStore(self.inner.clone(), self.abandon, self.bound_s)
        self._clones.append(twin)
        return twin


def formed_group(ranks: list[int] | None, timeout_s: float, formation_s: float = FORMATION_S):
    """``dist.new_group(ranks)`` (None: every rank) of gloo, made under a timeout of at most
    ``formation_s`` (its connects move a few bytes) and then given ``timeout_s`` for its
    collectives, which at a slow link may take hours (``plan.network.collective_timeout_s``): a
    member lost while a regroup makes its groups fails the others here within ``formation_s``
    (at once where the coordinator has published the loss while they wait for its address: the
    default group's store is a ``FormationStore``; about five times it where it died connecting),
    and they regroup again, rather than wait out the collective timeout. Collective."""
    from torch.distributed import distributed_c10d  # noqa: PLC0415 - a private helper, where torch has it

    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    timeout = timedelta(seconds=timeout_s or 600.0)
    # Without the helper (an older torch) the group keeps the collective timeout throughout.
    forming = min(timeout, timedelta(seconds=formation_s)) if set_timeout is not None else timeout
    group = dist.new_group(ranks, backend="gloo", timeout=forming)  # every rank, once: collective
    if (ranks is None or dist.get_rank() in ranks) and forming < timeout:
        set_timeout(timeout, group)
    return group


class MembershipChanged(RuntimeError):
    """The group this collective ran on has lost a member: abandon it and regroup."""


class Excluded(RuntimeError):
    """This host is not a member of the newest epoch (it was declared failed)."""


class JoinRefused(ValueError):
    """The coordinator turned this joiner's request down (not signed with a proof of the run
    token, or with one used already)."""


class RunFinished(RuntimeError):
    """A joiner's wait ended because the run finished before the members could admit it."""


class NoStateHolder(RuntimeError):
    """Only joiners are left, and the run has not finished: every member that held the training
    state was lost before they were admitted. The launcher restores every host from the
    snapshots (exit ``EXIT_NO_STATE_HOLDER``)."""


# A joiner's exit code when it found no member left to admit it (``NoStateHolder``).
EXIT_NO_STATE_HOLDER = 5


# A trainer's exit code when it stopped because fewer than --min-workers were left for longer
# than --join-timeout (its snapshot taken): the launcher tells the user how to resume.
EXIT_BELOW_MIN_WORKERS = 4


class BelowMinWorkers(RuntimeError):
    """Fewer than ``--min-workers`` members, and no joiner came within ``--join-timeout``."""


def sync_boundary(step: int, period: int) -> int:
    """The first sync boundary (a multiple of ``period``) at or after ``step``."""
    return -(-step // period) * period


def parse_members(text: str) -> list[int]:
    return [int(h) for h in text.split(",") if h != ""]


class Membership:
    """A trainer's view of the epochs. ``changed()`` is cheap (a field the heartbeat thread
    updates) and is what the Communicator polls while it waits for a collective."""

    def __init__(
        self,
        addr: str,
        port: int,
        host: int,
        members: list[int],
        timeout_s: float,
        period: int | Callable[[], int] = 1,
    ) -> None:
        self.host = host
        self.join_request = ""  # its signed request to join (launch/admission.py's Pass.sign)
        self.epoch = 0
        self.members = list(members)
        self.timeout_s = timeout_s
        # Steps between sync boundaries, where joiners are admitted: a number, or the
        # algorithm's ``sync_period`` (which changes, e.g. after a warm start), asked each time.
        self.period = period
        self.published = 0  # the newest epoch the heartbeat thread has seen
        # host -> the site of the machine that joined as it (a spare of another site's), read at
        # each epoch where ``follow_sites`` (--hierarchy sites: the coordinator's site numbers
        # are the run's; --hierarchy auto numbers the sites it measures its own way)
        self.sites: dict[int, int] = {}
        self.follow_sites = False
        # --hierarchy auto: a host new to the run is placed in a site by its measured links
        # (``Communicator._place_joiners``); a newcomer until its first regroup completes.
        self.measure_joiners = False
        self.newcomer = not members
        # The host whose state this worker holds a copy of, for an average a regroup has still
        # to redo (ft/elastic.py: the copy is left out of it while that host is a member)
        self.holds_copy: int | None = None
        # What this worker received of a hand-over a lost member cut short, by part
        # (``ft.handover.PartReceived``: the retry sends only the rest)
        self.received: dict = {}
        # A deferred hand-over's sends (``Communicator.send_later``): waited on at the sync
        # where the joiner meets the members, retired at a regroup before it
        self.sending = None  # (comm.communicator.PostedSends)
        self.published_leave = 0  # the newest one that lost members: collectives give up
        self._where = (addr, port)
        self._store = None
        self._forming: FormationStore | None = None  # the store of this epoch's groups
        # With redundancy: each epoch also gets a group of its own for snapshot shipments,
        # formed right after the training group by every member (they never share a group with
        # the training collectives, which run in another thread).
        self.snapshot_groups = False
        self.snapshot_group = None
        # Admission of joiners: the boundary this worker has committed to reach in this epoch
        # (None: just regrouped), what it proposed, and the step all agreed on.
        self._lock = threading.Lock()
        self._horizon: int | None = None
        self._proposal: int | None = None
        self._target: int | None = None

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

    def evict(self, host: int, signature: str) -> None:
        """Ask the coordinator to drop ``host`` from the run (its contributions were rejected
        ``--max-rejections`` times in a row). ``signature`` proves the asker holds the run token
        and is good for this epoch only (``launch/admission.py``); the coordinator drops the host
        when most of the other members ask."""
        store = self.store()
        store.set(f"evict/{host}/{self.host}", signature)
        store.add("evict/n", 1)  # the coordinator reads the requests when this moves

    def changed(self) -> bool:
        """Members were lost since this worker's epoch began: abandon what waits on them."""
        return self.published_leave > self.epoch

    def joining(self) -> bool:
        return self.published > self.epoch and not self.changed()

    def observe(self, store, newest: int) -> None:
        """The heartbeat thread's poll: learn of new epochs (and which lost members), and post
        this worker's proposal for a join at once, so that peers waiting for it need not wait
        for this worker's next step (it may be inside a collective that waits for them)."""
        for e in range(self.published + 1, newest + 1):
            if not store.check([f"kind/{e}"]) or store.get(f"kind/{e}") != b"join":
                self.published_leave = max(self.published_leave, e)
        self.published = max(self.published, newest)
        if self.joining():
            with self._lock:
                if self._proposal is None and self._horizon is not None:
                    self._propose(store, self._horizon)

    def boundary(self, step: int) -> int:
        return sync_boundary(step, self.period() if callable(self.period) else self.period)

    def _propose(self, store, step: int) -> None:
        store.set(f"at/{self.epoch}/{self.host}", str(step))
        self._proposal = step

    def going_on_after(self, step: int) -> None:
        """A regroup has just agreed that this member goes on after ``step``: the boundary it is
        heading for is known before its next step starts, so its heartbeat can post it while
        the training thread still redoes a failed average (else a join epoch published then
        would wait on this member's proposal until the store timeout)."""
        with self._lock:
            self._horizon = self.boundary(step)

    def admit_before(self, step: int) -> bool:
        """At the start of ``step``: whether to regroup now, before it, to admit a joiner. Every
        member of this epoch returns True at the same step (see the module's docstring)."""
        with self._lock:
            if self._horizon is None:
                self._horizon = self.boundary(step - 1)
            if not self.joining():
                self._horizon = self.boundary(step)
                return False
            if self._proposal is None:
                self._propose(self.store(), self._horizon)
            if step - 1 < self._proposal:
                return False  # this worker finishes the period it is in first
        if self._target is None:
            self._target = self._agree()
        return step - 1 >= self._target

    def _agree(self) -> int:
        """The largest of the members' proposals, once all have posted one."""
        store = self.store()
        keys = [f"at/{self.epoch}/{h}" for h in self.members]
        deadline = time.monotonic() + self.timeout_s
        mine = f"at/{self.epoch}/{self.host}"
        while not store.check(keys):
            if not store.check([mine]):  # a restarted coordinator's store: post it again
                store.set(mine, str(self._proposal))
            self.observe(store, int(store.add("epoch", 0)))  # the heartbeat thread's job, sooner
            if self.changed():  # a member was lost meanwhile: regroup for that first
                raise MembershipChanged("a member was lost while a joiner waited")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the members of epoch {self.epoch} did not agree when to admit a joiner")
            time.sleep(POLL_S)
        return max(int(store.get(k)) for k in keys)

    def request_join(self) -> None:
        """A joiner asks the coordinator to be admitted; the epochs after the current one are
        what it waits for."""
        store = self.store()
        self.epoch = self.published = self.published_leave = int(store.add("epoch", 0))
        store.set(f"join/{self.host}", self.join_request)  # signed with its proof of the run token

    def finish(self, stopped: bool = False) -> None:
        """This member has left its training loop: a joiner still waiting will not be admitted.
        ``stopped``: it left early, below ``--min-workers`` (a broker says the run did not end)."""
        store = self.store()
        if stopped:
            store.set("stopped", "1")
        store.set("finished", "1")

    def stopping(self) -> bool:
        """The members of this epoch decided to stop below ``--min-workers`` (rank 0 did)."""
        return bool(self.store().check(["stopped"]))

    def wait_published(self, timeout_s: float) -> bool:
        """After a collective failed on its own: is an epoch that lost members coming? (False:
        the error was not a lost member, and is the caller's to raise.)"""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.observe(self.store(), self._newest())
            if self.changed():
                return True
            time.sleep(POLL_S)
        return False

    def _newest(self) -> int:
        return int(self.store().add("epoch", 0))

    def next_epoch(self) -> tuple[int, list[int]]:
        """The newest epoch once all its members are ready to form it: hosts that fail while the
        others wait make the coordinator publish yet another epoch, which is taken instead. But
        an epoch this worker said it was ready for, and all its members were, is the one taken,
        even if a newer one has appeared: a member that saw them all ready is forming it already.
        A joiner (no members yet) waits past epochs that do not admit it, and, once one does, as
        long as the members take to reach their sync boundary."""
        store = self.store()
        joiner = not self.members
        announced: dict[int, list[int]] = {}  # epochs this worker said it was ready for
        floor = self.epoch
        deadline = time.monotonic() + self.timeout_s
        while True:
            for e, members in sorted(announced.items()):
                if store.check([f"ready/{e}/{h}" for h in members]):
                    return e, members
            epoch = self._newest()
            if epoch <= floor:
                if joiner and store.check(["finished"]):
                    raise RunFinished(_too_late(store))
                refused = f"joinrefused/{self.host}/{self.join_request.partition(':')[0]}"
                if joiner and self.join_request and store.check([refused]):
                    raise JoinRefused(
                        "the coordinator refused this worker's join request: it is not signed with a "
                        "proof of the run token (or that proof was used already)"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no epoch after {self.epoch} was published in {self.timeout_s:.0f} s")
                time.sleep(POLL_S)
                continue
            members = parse_members(store.get(f"members/{epoch}").decode())
            if self.host not in members:
                if joiner:
                    floor = epoch
                    continue
                raise Excluded(
                    f"host {self.host} is not in epoch {epoch} ({members}): it was declared failed"
                )
            if epoch not in announced:
                store.set(f"ready/{epoch}/{self.host}", "1")
                announced[epoch] = members
                continue
            if joiner and store.check(["finished"]):  # admitted too late: the members are done
                raise RunFinished(_too_late(store))
            if time.monotonic() > deadline and not joiner:
                raise TimeoutError(f"members of epoch {epoch} ({members}) did not all get ready")
            time.sleep(POLL_S)

    def join(self, epoch: int, members: list[int], backend: str = "gloo") -> None:
        """Leave the old default group without a word to it and form the new one."""
        gc.collect()  # pending works and DDP reducers of the old group go first
        if dist.is_initialized():
            # Never freed: its destructor joins its threads, and one may wait on a live peer for
            # data of an abandoned collective that only that peer's own destructor would cut off
            # (each waiting for the other: seen with four hosts, a kill in DiLoCo's all-reduce).
            retire(dist.group.WORLD)
            dist.destroy_process_group()
        gc.collect()
        # Formed under FORMATION_S (a few connects), then given the collective timeout, which on
        # a slow link is hours: a member lost while the group forms (it registered and died, and
        # the others wait for its address) fails the others within a minute (about five where
        # it died connecting: ``FormationStore``), and they regroup again, where they sat out
        # the whole collective timeout (seen in a soak with a kill every 20 s: every member
        # stuck, and killed one by one, until none held the state).
        # Its store's waits give up at once when a newer epoch loses members (the coordinator has
        # seen a member die, maybe one it waits for): a member that died before posting its
        # address costs the others its detection, not the bound.
        from torch.distributed import distributed_c10d  # noqa: PLC0415 - a private helper, as formed_group

        set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
        timeout = timedelta(seconds=self.timeout_s)
        forming = min(timeout, timedelta(seconds=FORMATION_S)) if set_timeout is not None else timeout
        abandon = lambda: self.published_leave > epoch  # noqa: E731 - read by the store, and here
        if abandon():  # its peers are leaving it: one arriving late would find their addresses
            raise MembershipChanged(f"epoch {epoch} lost members before this worker formed it")
        # A formation that failed leaves torch's count of unnamed groups where the group being
        # made took it (only destroying a default group resets it), and the next default group
        # would be named, so keyed, "1" on this worker and "0" on its peers: none would form.
        if hasattr(distributed_c10d, "_world"):  # (the old group is destroyed above)
            distributed_c10d._world.group_count = 0
        retire(self._forming)  # the old group's (retired, never destroyed) may still call it
        self._forming = FormationStore(dist.PrefixStore(f"geotrain/epoch{epoch}", self.store()), abandon)
        dist.init_process_group(
            backend,
            store=self._forming,
            rank=members.index(self.host),
            world_size=len(members),
            timeout=forming,
        )
        if forming < timeout:
            set_timeout(timeout, dist.group.WORLD)
        if self.snapshot_groups:
            self.snapshot_group = formed_group(None, self.timeout_s)
        # The machines' sites where the coordinator said (a spare of another site took a lost
        # host's place): read by every member at the same epoch, so all form the same groups.
        if self.follow_sites:
            store = self.store()
            self.sites.update({h: int(store.get(f"site/{h}")) for h in members if store.check([f"site/{h}"])})
        with self._lock:
            self.epoch, self.members = epoch, list(members)
            self.published = max(self.published, epoch)
            self._horizon = self._proposal = self._target = None


def _too_late(store) -> str:
    if store.check(["stopped"]):
        return "the members stopped below --min-workers before this joiner could be admitted; resume the run"
    return "the run finished before this joiner could be admitted"


def host_beating(addr: str, port: int, attempt: int | str, host: int, window_s: float = 1.5) -> bool:
    """Whether a trainer is beating as ``host`` now (its counter moves within ``window_s``)."""
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    key = f"hb/{attempt}/{host}"
    before = store.add(key, 0)
    time.sleep(window_s)
    return store.add(key, 0) != before


def spare_placed(addr: str, port: int, host: int) -> bool:
    """Whether the backup pool has given ``host``'s place to a spare that is not admitted yet."""
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    return bool(store.check([f"placed/{host}"]))


def first_hosts(addr: str, port: int, timeout_s: float = 30.0) -> tuple[int, int, list[int]]:
    """How many hosts the run started with (a joiner's data shards are dealt over them), its
    newest epoch and that epoch's members."""
    store = dist.TCPStore(
        addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    newest = int(store.add("epoch", 0))
    members = parse_members(store.get(f"members/{newest}").decode())
    return len(parse_members(store.get("members/0").decode())), newest, members


def wait_for_vacancy(
    addr: str, port: int, label: int, timeout_s: float = 30.0, sign: Callable[[int], str] | None = None
) -> int:
    """A spare in the backup pool (``--spare``; FusionAI's backup providers): register, beat
    under ``poolhb/{i}`` and wait until the coordinator gives it the place of a lost host
    (``assign/{i}``); returns that host. ``label`` names this machine in the coordinator's record
    (< 0: its registration number). RunFinished when the run ends first, or when the coordinator
    it reached stops answering for ``timeout_s`` (a broker exits once the run is over);
    TimeoutError when none ever answered."""
    deadline = time.monotonic() + timeout_s
    store, me = None, 0
    while True:
        try:
            if store is None:
                store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=max(0.5, min(5.0, timeout_s))))  # fmt: skip
            if not me:
                me = int(store.add("spares", 1))
            if not store.check([f"spare/{me}"]):  # first, or a restarted coordinator's fresh store
                store.add("spares", max(0, me - int(store.add("spares", 0))))
                if sign is not None:  # its registration, signed with its proof of the run token
                    store.set(f"sparepass/{me}", sign(me))
                store.set(f"spare/{me}", str(label if label >= 0 else me))
            store.add(f"poolhb/{me}", 1)
            if store.check([f"assign/{me}"]):
                host = int(store.get(f"assign/{me}"))
                if store.compare_set(f"claim/{me}", "", "taken") == b"taken":
                    return host
                me = 0  # too late: the place went to another spare; wait on under a new number
                continue
            if store.check([f"claim/{me}"]):  # a place taken back while this spare was away
                me = 0
                continue
            if store.check(["finished"]):
                raise RunFinished("the run finished; this spare was not needed")
            deadline = time.monotonic() + timeout_s
        except RunFinished:
            raise
        except Exception as e:
            store = None
            if time.monotonic() > deadline:
                if not me:  # never reached: a wrong address, or no run there
                    why = type(e).__name__
                    raise TimeoutError(f"no coordinator answers at {addr}:{port} ({why})") from None
                raise RunFinished("the coordinator is gone (the run is over): this spare was idle") from None
        time.sleep(0.25)
