"""The communicator: the only place in geotrain that calls collectives.

Every sync algorithm talks to an injected ``Communicator`` so that tests can count calls and
bytes, and so that every algorithm's cost is accounted the same way:

- ``payload_bytes``: the bytes of the tensors handed to collectives (what the algorithm asked to
  move);
- ``sent_bytes``/``recv_bytes``: the bytes each worker puts on / takes off its link, from the
  bandwidth-optimal ring all-reduce, 2 (N-1)/N of the payload each way (exact for gloo's ring
  and NCCL's ring algorithms, an estimate for tree variants);
- ``blocked_s``: wall time this worker spent waiting for a collective to finish, which is the
  communication *not* hidden behind compute.

gloo has no ``AVG`` reduction, so a mean is a ``SUM`` followed by a division on wait. Optional
software latency (this kernel has no netem) makes each collective last at least
``2 (N-1) * latency``: one link latency per step of the ring.

With a ``membership`` (``--on-failure continue``), every wait polls it: a collective on a peer
that froze or lost its link never returns (no reset arrives), so once the coordinator publishes
an epoch newer than the one the collective was launched in, the wait is abandoned with
``MembershipChanged`` and the caller regroups. (Newer than at launch, not than now: a wait in
another thread, such as a DDP bucket's, must give up even after the main thread has regrouped.)

A collective that outlasts the process group's timeout (gloo's "Timed out waiting ... for recv")
is raised as ``CollectiveTimeout``: one line naming the collective, its bytes, the links and the
option to change, in place of a traceback from every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.guard import (
    GATHERED,
    Verdict,
    clip_norm,
    judge,
    message_norm,
    parse_aggregate,
    robust_mean,
)
from geotrain.comm.hierarchy import Chain, SiteGroups, site_groups, two_level_sum_
from geotrain.ft.membership import FORMATION_S, MembershipChanged, retire

INTERRUPT_POLL = timedelta(milliseconds=50)
NCCL_POLL_S = 0.001


class CollectiveTimeout(Exception):
    """A collective or transfer waited longer than the process group's timeout. Not a
    ``RuntimeError``: the elastic paths that take a failed collective for a lost member must not
    take this one for one (its peers are alive; the link is too slow for the timeout)."""


TIMEOUT_MARK = "waited longer than the collective timeout"


# gloo's words for its own timeout on a transfer, and for a transfer on a connection that an
# earlier timeout closed (DDP's backward surfaces either, by which bucket's all-reduce it reads)
_GLOO_TIMEOUT = ("Timed out waiting", "Application timeout caused pair closure")


def is_timeout(error: BaseException) -> bool:
    """gloo's own timeout on a transfer (not a poll of ``wait_work`` that timed out)."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _GLOO_TIMEOUT)


def timeout_message(op: str, nbytes: int | None, workers: int, timeout_s: float, link: str) -> str:
    """One line: which collective, how many bytes, the limit, the links, and what to change."""
    what = f"the {op} of {nbytes:,} bytes" if nbytes is not None else f"a {op}"
    limit = f" of {timeout_s:g} s" if timeout_s else ""
    links = f" on {link}" if link else ""
    return (
        f"{what} among {workers} workers {TIMEOUT_MARK}{limit}{links}: a peer froze or lost its "
        "link, or the link is slower than that allows; raise --timeout-s (0 derives it from the "
        "model and the slowest link)"
    )


def timeout_line(error: BaseException, workers: int, timeout_s: float, link: str) -> str | None:
    """The one line for an error that is a collective's timeout, else None: a
    ``CollectiveTimeout``, one re-raised through a future (PyTorch DDP's backward wraps what a
    comm hook raised in a ``RuntimeError``), or gloo's own where no communicator waited (DDP's
    built-in all-reduce, ``all_gather_object``)."""
    if isinstance(error, CollectiveTimeout):
        return str(error)
    wrapped = re.search(rf"\b(?:the|a) [^\n]*{TIMEOUT_MARK}[^\n]*", str(error))
    if wrapped:
        return wrapped.group(0).strip()
    if is_timeout(error):
        return timeout_message(
            "collective outside geotrain's Communicator (PyTorch DDP's gradient all-reduce, or an "
            "exchange of state)", None, workers, timeout_s, link,
        )  # fmt: skip
    return None


# What gloo and NCCL say when the process at the other end of a connection is gone...
_PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited")
# ...in a message of theirs: not this host's keeper or store, whose failures say the same words
_BACKEND = re.compile(r"gloo|pair\.cc|NCCL")


def peer_lost_line(error: BaseException, rank: int) -> str | None:
    """One line for a collective that failed because a peer's process or link went away (a
    consequence: the launcher, or whoever watches the hosts, reports the host that failed), else
    None."""
    text = str(error)
    said = _PEER_GONE.search(text) if isinstance(error, RuntimeError) and _BACKEND.search(text) else None
    if said is None:
        return None
    gone = said.group(0)
    return f"host {rank}: a collective failed, a peer gone ({gone}); that peer's failure is reported apart"


def wait_work(work, interrupt: Callable[[], bool] | None, timed_waits: bool = True) -> None:
    """``work.wait()``, abandoned with ``MembershipChanged`` once ``interrupt()`` says so.

    A wait with a timeout returns the moment the work completes, so polling costs no latency;
    a timed-out wait leaves the work as it was (gloo). NCCL aborts its communicator when a timed
    wait expires, so on a group with NCCL (``timed_waits`` False) the work is polled instead."""
    if interrupt is None:
        work.wait()
        return
    while True:
        if work.is_completed():
            work.wait()  # its result, or its error
            return
        if not timed_waits:
            time.sleep(NCCL_POLL_S)
        else:
            try:
                work.wait(timeout=INTERRUPT_POLL)
                return
            except RuntimeError:
                if work.is_completed():  # it finished (or failed) as the wait timed out
                    work.wait()  # its result, or its own error
                    return
        if interrupt():
            raise MembershipChanged("the group lost a member while this collective waited")


def wait_transfers(works: list, interrupt: Callable[[], bool] | None) -> None:
    """Every point-to-point ``work.wait()``, abandoned with ``MembershipChanged`` once
    ``interrupt()`` says so.

    Not polled like a collective: gloo takes a timed-out wait on a send or receive for a failed
    transfer and closes the group's connections. So a thread of its own waits on them plainly
    while this one watches ``interrupt``. Nor can a lost peer's connection error be counted on to
    end them: gloo tells it to the transfers queued on that connection, not to the one whose
    payload it is reading or writing, which waits for the group's timeout (a member killed
    mid-stripe of a joiner's state held the joiner, alive and beating, and every epoch after it
    waited for that joiner to be ready). An abandoned waiter and its works are retired."""
    if interrupt is None:
        for work in works:
            work.wait()
        return
    done = threading.Event()
    failed: list[BaseException] = []

    def waiter() -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as e:  # the transfer's own error, raised by the caller
            failed.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=waiter, name="geotrain-transfers", daemon=True)
    thread.start()
    while not done.wait(INTERRUPT_POLL.total_seconds()):
        if interrupt():
            retire((thread, works))
            raise MembershipChanged("the group lost a member while a point-to-point transfer waited")
    if failed:
        raise failed[0]


@dataclass
class CommStats:
    """Cumulative accounting; ``delta`` gives the part since a snapshot (one training step)."""

    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    blocked_s: float = 0.0
    wan_sent_bytes: int = 0  # of sent_bytes, what crossed sites (two-level all-reduces only)

    def copy(self) -> CommStats:
        return CommStats(**asdict(self))

    def delta(self, since: CommStats) -> CommStats:
        return CommStats(**{k: getattr(self, k) - getattr(since, k) for k in asdict(self)})

    def as_dict(self) -> dict:
        return asdict(self)


def corrupt_(tensor: torch.Tensor, how: str) -> None:
    """Chaos (``--chaos corrupt``): spoil a contribution in place, as a broken or hostile worker
    would: ``nan``, ``inf``, ``signflip`` or ``scale=X``."""
    with torch.no_grad():
        if how in ("nan", "inf"):
            tensor.fill_(float(how))
        elif how == "signflip":
            tensor.neg_()
        elif how.startswith("scale="):
            tensor.mul_(float(how.partition("=")[2]))
        else:
            raise ValueError(f"unknown corruption {how!r}; accepted: nan, inf, signflip, scale=X")


# Verdicts update the counts --max-rejections reads; DDP's buckets are judged on threads of their
# own. One lock for the process: a communicator is copied with its state (no lock to pickle).
_JUDGING = threading.Lock()


class Handle:
    """An in-flight collective. ``wait()`` blocks, counts the time blocked, and finishes a mean."""

    def __init__(
        self,
        comm: Communicator,
        work,
        tensor,
        divide_by: int,
        launched: float,
        op: str = "",
        nbytes: int = 0,
        finish: Callable[[], None] | None = None,
    ):
        self._comm = comm
        self._finish = finish  # what turns the collective's output into the result (a robust mean)
        self._op, self._nbytes = op, nbytes
        # One collective, or several (an uneven gather is one broadcast per worker).
        self._works = [w for w in (work if isinstance(work, list) else [work]) if w is not None]
        self._tensor = tensor
        self._divide_by = divide_by
        self._launched = launched
        self._done = False
        self._interrupt = comm.interrupt_after_now()
        # A checked mean whose verdict left a contribution out takes the mean again. Where the
        # wait runs on a thread of its own (DDP's buckets), a collective issued there could
        # cross the backward's next launches in another order on another worker: with
        # ``defer_redo`` the mean is left in ``redo``, for the training thread to call.
        self.defer_redo = False
        self.redo: Callable[[], torch.Tensor] | None = None

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def is_completed(self) -> bool:
        """Done, as ``wait`` would see it: every work completed and the emulated latency
        (``min_collective_s``) past."""
        if self._done:
            return True
        if time.perf_counter() < self._launched + self._comm.min_collective_s:
            return False
        return all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if self._done:
            return self._tensor
        start = time.perf_counter()
        with self._comm.naming_timeouts(self._op, self._nbytes):
            for work in self._works:
                wait_work(work, self._interrupt, not self._comm.nccl)
        remaining = self._launched + self._comm.min_collective_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self._comm.stats.blocked_s += time.perf_counter() - start
        if self._finish is not None:
            self._finish()
        if self._divide_by > 1:
            self._tensor.div_(self._divide_by)
        self._done = True
        return self._tensor


@dataclass
class Communicator:
    """Collectives over one process group, with accounting.

    ``group=None`` means the default group. A communicator over a world of one (no process group
    initialised) is valid and moves nothing, which is what ``nosync`` and single-process
    references use.
    """

    group: dist.ProcessGroup | None = None
    latency_s: float = 0.0
    stats: CommStats = field(default_factory=CommStats)
    control_calls: int = 0
    membership: Any = None  # with .epoch and .published (ft.membership.Membership): waits give up
    timeout_s: float = 0.0  # the process group's timeout, for the message when one expires
    link: str = ""  # the links, described, for the same message
    # The site of each host: all-reduces over the default group go in two levels (comm/hierarchy.py)
    site_of_host: list[int] | None = None
    # > 0: every mean all-reduce leaves out contributions that are not finite or whose norm is
    # more than this times the others' median (comm/guard.py); 0: off
    max_norm_ratio: float = 0.0
    # "clip": also scale each contribution down to the median norm (comm/guard.py)
    aggregate: str = "mean"
    # > 0 (--max-norm-ratio auto): max_norm_ratio applies only while the group has this many
    # workers or more, decided again at every rebind (all members alike); below, only what is
    # not finite is left out (a ratio of inf). 0: the ratio everywhere
    auto_min_workers: int = 0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not (self.max_norm_ratio == 0 or self.max_norm_ratio >= 1):
            raise ValueError(f"max_norm_ratio must be >= 1, or 0 for off; got {self.max_norm_ratio}")
        self._aggregate, self._trim = parse_aggregate(self.aggregate)
        self._wanted_ratio = self.max_norm_ratio
        self._bound = False  # rebound once already: later rebinds are regroups
        self.corrupt_next = ""  # chaos (--chaos corrupt): how to corrupt the next contribution
        self.corrupt_shard = ""  # the same for a quantised codec's shard of the mean (second phase)
        self.rejected_by_rank: dict[int, int] = {}  # contributions left out, by group rank
        # This step's verdicts by host (train.py counts rejections per step for --max-rejections)
        self.step_checked: set[int] = set()
        self.step_rejected: set[int] = set()
        # Ranks whose contributions the averages under way leave out, known alike on every
        # worker (``leaving_out``: an average redone after a regroup, where they hold copies of
        # the leader's state): they send zeros and the mean is over the others.
        self.left_out: frozenset[int] = frozenset()
        self.two_level: SiteGroups | None = None
        self._chain: Chain | None = None
        self.rebind(self.group)

    def rebind(self, group: dist.ProcessGroup | None) -> None:
        """Talk over ``group`` from now on (a new membership epoch's group; None: the default).
        With sites, collective: the two levels' groups are made for the new members."""
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        # NCCL carries the CUDA tensors (gloo, in the same group, the CPU control numbers)
        self.nccl = self.distributed and "nccl" in str(dist.get_backend(self.group))
        if self.auto_min_workers:
            # Below the minimum a ratio cannot say which of two is wrong, but what is not finite
            # is wrong wherever it comes from: a ratio of inf leaves out only that.
            few = math.inf if self._wanted_ratio > 0 and self.world_size > 1 else 0.0
            self.max_norm_ratio = self._wanted_ratio if self.world_size >= self.auto_min_workers else few
        # Never freed, like an epoch's default group: a subgroup's destructor joins its threads,
        # and one may wait on a lost peer for data of an abandoned collective.
        retire(self.two_level)
        self.two_level = None
        if self.site_of_host is not None and self.world_size > 1 and group is None:
            members = getattr(self.membership, "members", None) or list(range(self.world_size))
            if max(members) >= len(self.site_of_host):
                raise ValueError(
                    f"--sites names {len(self.site_of_host)} hosts, but host {max(members)} is in the run"
                )
            if getattr(self.membership, "measure_joiners", False):
                self._place_joiners(members)
            # A spare of another site that took a host's place is in its machine's site.
            moved = getattr(self.membership, "sites", None) or {}
            self.site_of_host = [moved.get(h, s) for h, s in enumerate(self.site_of_host)]
            sites = [self.site_of_host[h] for h in members]
            # At start-up peers may still be loading: the whole timeout. In a regroup every member
            # is up, and one lost while the groups form must not hold the others for hours.
            forming = FORMATION_S if self._bound else (self.timeout_s or 600.0)
            self.two_level = site_groups(sites, self.rank, self.timeout_s, forming)
        # A job of the old group stuck on a lost peer must not hold up the new group's.
        if self._chain is not None:
            self._chain.close()
        self._chain = Chain() if self.two_level is not None else None
        self._bound = True

    def _place_joiners(self, members: list[int]) -> None:
        """``--hierarchy auto``: the site of each host new to the run (a spare, a replacement),
        from its links to the members, measured here (``linkmatrix.site_of_joiner``): the host
        number it took says nothing of where its machine is. Every member takes the moves the
        lowest-ranked old member knows, so all form the same groups."""
        from geotrain.comm.linkmatrix import joiner_rounds, measure, site_of_joiner

        membership = self.membership
        reports = self.all_gather_object((membership.newcomer, dict(membership.sites)))
        old = [r for r, (new, _) in enumerate(reports) if not new]
        joiners = [r for r, (new, _) in enumerate(reports) if new]
        membership.sites = dict(reports[old[0]][1]) if old else {}
        sites = [membership.sites.get(h, s) for h, s in enumerate(self.site_of_host)]
        old_sites = [sites[members[r]] for r in old]
        if not joiners or len(set(old_sites)) < 2:  # one site left: nothing to tell them from
            return
        t0 = time.perf_counter()
        with self.control_traffic():  # like the regroup's agreement: not the training step's bytes
            matrix = measure(self, schedule=joiner_rounds(joiners, old))
        said, fresh = [], max(sites) + 1
        for j in joiners:
            site, best = site_of_joiner([matrix[j][r] for r in old], old_sites)
            if site is None:  # alike to every site: a site of its own
                site, fresh = fresh, fresh + 1
            membership.sites[members[j]] = site
            links = ", ".join(f"{v * 8e-6:.0f} Mbit/s to site {s}" for s, v in sorted(best.items()))
            said.append(f"host {members[j]} ({links}) joins site {site}")
        if self.rank == 0:
            took = time.perf_counter() - t0
            print(f"geotrain: joiners' links measured in {took:.1f} s: {'; '.join(said)}", file=sys.stderr)

    def close(self) -> None:
        """Stop the two-level chain and let go of its groups (before the process group goes)."""
        if self._chain is not None:
            self._chain.close(wait_s=5.0)
            self._chain = None
        retire(self.two_level)
        self.two_level = None

    @contextlib.contextmanager
    def leaving_out(self, ranks):
        """Inside, the averages leave out the contributions of ``ranks`` (the same set on every
        worker): mean all-reduces (checked or not, robust or not), weighted sums (``screen``:
        their weight goes with them), the quantised codecs' rows, the gathers' messages and a
        site's average (where some of the site stays). Not where it would leave nothing (every
        rank), nor with none."""
        ranks = frozenset(r for r in ranks if 0 <= r < self.world_size)
        previous = self.left_out
        self.left_out = ranks if len(ranks) < self.world_size else frozenset()
        try:
            yield
        finally:
            self.left_out = previous

    @contextlib.contextmanager
    def control_traffic(self):
        """Inside, collectives are measurements (a link probe, a profile), not training: counted
        in ``control_calls``, left out of the bytes and seconds of ``stats`` (and so of a step's
        record where DreamDDP re-profiles in it; the emulated links' own counters still see
        them). For the training thread's collectives: whatever another thread counts meanwhile
        is left out too (none runs during a profile: DDP's hooks run in its backward)."""
        stats = self.stats.copy()
        try:
            yield
        finally:
            self.control_calls += self.stats.calls - stats.calls
            self.stats = stats

    @contextlib.contextmanager
    def naming_timeouts(self, op: str, nbytes: int):
        """Waits inside raise gloo's timeout as ``CollectiveTimeout``, naming ``op`` and its bytes."""
        try:
            yield
        except RuntimeError as e:
            if not is_timeout(e):
                raise
            message = timeout_message(op, nbytes, self.world_size, self.timeout_s, self.link)
            raise CollectiveTimeout(message) from None

    @property
    def min_collective_s(self) -> float:
        return 2 * (self.world_size - 1) * self.latency_s

    def _account(self, nbytes: int, workers: int = 0) -> None:
        """One ring all-reduce of ``nbytes`` among ``workers`` (0: the whole group)."""
        n = workers or self.world_size
        self.stats.calls += 1
        self.stats.payload_bytes += nbytes
        wire = 2 * (n - 1) * nbytes // n
        self.stats.sent_bytes += wire
        self.stats.recv_bytes += wire

    def account_external_bytes(self, nbytes: int) -> None:
        """Count one all-reduce of ``nbytes`` that a library performed itself."""
        if self.world_size > 1:
            self._account(nbytes)

    def account_external(self, tensors: list[torch.Tensor]) -> None:
        """Count an all-reduce of ``tensors`` that a library (PyTorch DDP) performed itself."""
        if self.world_size > 1:
            self._account(sum(t.numel() * t.element_size() for t in tensors))

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "mean", async_op: bool = False, screen: bool = False
    ):
        """Sum or mean ``tensor`` in place across the group. With ``max_norm_ratio`` a mean leaves
        out the contributions ``comm.guard`` rejects, and so does a sum with ``screen`` (its caller
        sums weights along, as ``InFlight`` does).

        Returns a ``Handle`` when ``async_op`` (the caller must ``wait()`` before reading the
        tensor), else the reduced tensor.
        """
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        launched = time.perf_counter()
        work = None
        nbytes = tensor.numel() * tensor.element_size()
        divide_by = self.world_size if op == "mean" else 1
        # A mean, or a sum whose caller divides by the weights it sums too (``screen``).
        guarded = (op == "mean" or screen) and tensor.is_floating_point()
        if guarded and self.corrupt_next:
            # A weighted sum's last value is its weight (sync/base.py's InFlight): the message is spoiled
            corrupt_(tensor.view(-1)[:-1] if screen and op == "sum" else tensor, self.corrupt_next)
            self.corrupt_next = ""
        robust = self._aggregate in GATHERED and op == "mean"
        checked = self.max_norm_ratio > 0 or self._aggregate != "mean"
        if guarded and checked and self._in_band(op):
            handle = self._checked_mean(tensor, nbytes)
            return handle if async_op else handle.wait()
        if guarded and self.left_out and not checked and self.world_size > 1:
            if self.rank in self.left_out:
                tensor.zero_()  # a weighted sum's weight too: it weighs nothing
            divide_by = self.world_size - len(self.left_out) if op == "mean" else 1
        if guarded and checked and self.world_size > 1:
            verdict = self._screen(tensor)
            if verdict.count == 0:  # nothing to average: every worker keeps its own (as it was)
                handle = Handle(self, None, tensor, 1, time.perf_counter())
                return handle if async_op else handle.wait()
            divide_by = verdict.count if op == "mean" else 1
            launched = time.perf_counter()  # the collective's own latency starts now
            if robust:
                handle = self._robust_mean(tensor, verdict.kept, launched)
                return handle if async_op else handle.wait()
        if self.world_size > 1:
            work = self._launch_sum(tensor, nbytes)
        handle = Handle(self, work, tensor, divide_by, launched, "all-reduce", nbytes)
        if async_op:
            return handle
        return handle.wait()

    def _launch_sum(self, tensor: torch.Tensor, nbytes: int):
        """Launch the sum of ``tensor`` over the group in place, counted: in two levels where
        there are sites (on the chain, in launch order), else one all-reduce. Returns its work."""
        if self.two_level is not None and self._chain is not None and tensor.is_contiguous():
            lan, wan = self.two_level.wire_bytes(tensor.numel(), tensor.element_size())
            self.stats.calls += 1
            self.stats.payload_bytes += nbytes
            self.stats.sent_bytes += lan + wan
            self.stats.recv_bytes += lan + wan
            self.stats.wan_sent_bytes += wan
            flat, groups = tensor.view(-1), self.two_level
            return self._chain.submit(lambda: two_level_sum_(flat, groups))
        self._account(nbytes)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def site_mean(self, tensor: torch.Tensor) -> None:
        """Average the contiguous ``tensor`` in place over this rank's site only (its LAN group:
        ``--site-H``), blocking. Nothing where the rank has no site peers: a site of one, sites of
        one host each, or no sites. Unchecked by ``max_norm_ratio``: a site's hosts trust one
        another (one lab, one cloud region); the check guards what crosses between sites."""
        groups = self.two_level
        if groups is None or groups.intra is None or self._chain is None:
            return
        launched, k = time.perf_counter(), groups.site_size
        site = [r for r, s in enumerate(groups.site_of_rank) if s == groups.site_of_rank[self.rank]]
        out = self.left_out & set(site)  # copies of the leader's, in an average redone (leaving_out)
        if out and len(out) < k:
            if self.rank in out:
                tensor.zero_()
            k -= len(out)  # the divisor; the bytes are the site's all the same
        nbytes = tensor.numel() * tensor.element_size()
        self._account(nbytes, groups.site_size)
        flat, intra = tensor.view(-1), groups.intra
        work = self._chain.submit(lambda: dist.all_reduce(flat, group=intra))  # in launch order
        Handle(self, work, tensor, k, launched, "site all-reduce", nbytes).wait()

    def _in_band(self, op: str) -> bool:
        """Whether a checked mean learns the verdict alongside the average (``_checked_mean``)
        rather than before it (``_screen``): a plain mean over one flat group. Clipping scales a
        contribution before it is sent, and a robust mean gathers instead of summing."""
        return op == "mean" and self._aggregate == "mean" and self.world_size > 1

    def _norm_table(self, tensor: torch.Tensor) -> torch.Tensor:
        """This worker's row of the check's table: its contribution's norm and whether it is
        finite (float64, on the tensor's device: NCCL reduces only there). A NaN or an inf
        anywhere makes the norm one, so the norm alone says the tensor is finite: the scan for
        them (12x the norm's time on a CPU) runs only where it does not, to tell a norm that
        overflowed float32 (values above 1e19) from a tensor that is not finite."""
        values = tensor.detach()
        norm = float(torch.linalg.vector_norm(values, dtype=torch.float32))
        finite = math.isfinite(norm)
        if not finite and bool(torch.isfinite(values).all()):
            norm, finite = float(torch.linalg.vector_norm(values, dtype=torch.float64)), True
        table = torch.zeros(self.world_size, 2, dtype=torch.float64, device=tensor.device)
        table[self.rank, 0] = norm if finite else 0.0
        table[self.rank, 1] = 1.0 if finite else 0.0
        return table

    def _checked_mean(self, tensor: torch.Tensor, nbytes: int) -> Handle:
        """A checked mean with no round trip before it: the table of norms (``_norm_table``)
        travels with the contributions, so a mean waited for inside backward (ssgd's and
        DreamDDP's buckets, a warm start's steps) costs no more latency than an unchecked one.
        A float32 or float64 message carries it in the same all-reduce, its 2 N last values
        (each worker writes its own row, the others are zeros: the sum is the table); a message
        in 16 bits, whose range a norm would overflow, sends it in a float64 all-reduce of its
        own, beside. When the verdict keeps every contribution, as it does but for a broken or
        hostile worker, the sum is the mean's. When it leaves one out, the sum is spoiled (a NaN
        cannot be subtracted, nor a 1e6-scaled vector without losing bits), so the mean is taken
        again from this worker's contribution (the message itself, left as it was while its copy
        travelled; or a copy kept for it), the rejected ones zeroed: bitwise what ``_screen``'s
        path gives. Every worker reaches the same verdict, so every one takes it again, in the
        order it waits (``Handle.redo`` where that wait is on another thread: DDP's buckets)."""
        out, w, n = self.left_out, self.world_size, tensor.numel()  # ``out``: as sent
        sent = tensor.detach()
        row = self._norm_table(sent if self.rank not in out else sent.new_zeros(1))
        together = tensor.dtype in (torch.float32, torch.float64)
        launched = time.perf_counter()
        self.control_calls += 1
        own: list[torch.Tensor] = []
        if together:
            buf = torch.empty(n + 2 * w, dtype=tensor.dtype, device=tensor.device)
            data, table = buf[:n], buf[n:].view(w, 2)
            if self.rank in out:
                data.zero_()  # a copy of the leader's state (``leaving_out``): it weighs nothing
            else:
                data.copy_(sent.reshape(-1))
            table.copy_(row)
            works = [self._launch_sum(buf, nbytes)]
        else:
            own.append(sent.clone())  # what the mean is taken again from, if it must be
            if self.rank in out:
                tensor.zero_()
            data, table = sent, row
            works = [dist.all_reduce(row, op=dist.ReduceOp.SUM, group=self.group, async_op=True)]
            works.append(self._launch_sum(tensor, nbytes))
        handle = Handle(self, works, tensor, 1, launched, "all-reduce", nbytes)

        def finish() -> None:
            verdict = self._judge_table(table.tolist(), out)
            if verdict.count == w - len(out):
                if together:
                    tensor.copy_(data.view_as(tensor))
                tensor.div_(verdict.count)
                own.clear()
                return
            if verdict.count == 0:  # nothing to average: every worker keeps its own (as it was)
                if not together:
                    tensor.copy_(own.pop())
                return
            mine = data if together else own.pop()
            if not verdict.kept[self.rank]:
                mine.zero_()
            elif together:
                mine.copy_(sent.reshape(-1))

            def redo() -> torch.Tensor:
                self._wait_blocked(self._launch_sum(mine, nbytes), time.perf_counter(), nbytes)
                return tensor.copy_(mine.view_as(tensor)).div_(verdict.count)

            if handle.defer_redo:
                tensor.zero_()  # not the spoiled sum, until ``handle.redo()`` writes the mean
                handle.redo = redo
            else:
                redo()

        handle._finish = finish
        return handle

    def _robust_mean(self, tensor: torch.Tensor, kept_ranks: list[bool], launched: float) -> Handle:
        """``--aggregate trimmed|median``: every contribution gathered, the same coordinate-wise
        statistic computed over the kept ones on every worker, written into ``tensor``."""
        flat = tensor.detach().reshape(-1)
        gathered = self.all_gather(flat, async_op=True)
        kept = torch.tensor(kept_ranks)

        def finish() -> None:
            rows = gathered.wait()[kept]
            tensor.copy_(robust_mean(rows, self._aggregate, self._trim).view_as(tensor))

        return Handle(self, None, tensor, 1, launched, finish=finish)

    def _screen(self, tensor: torch.Tensor) -> Verdict:
        """Before a mean all-reduce (``max_norm_ratio``): every worker's norm and finiteness,
        the same verdict everywhere (``comm.guard.judge``); a contribution left out is zeroed
        in place here. Returns the verdict (its count: the mean's divisor)."""
        table = self._norm_table(tensor)
        self.control_calls += 1
        start = time.perf_counter()  # waiting for the verdict is communication not hidden
        work = dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait_blocked(work, start, table.numel() * 8)
        rows = table.tolist()
        verdict = self._judge_table(rows, self.left_out)
        if verdict.count == 0:
            return verdict
        if self._aggregate == "clip" and verdict.kept[self.rank]:
            limit, norm = clip_norm([r[0] for r in rows], verdict.kept), rows[self.rank][0]
            if norm > limit:
                tensor.mul_(limit / norm)
        if not verdict.kept[self.rank]:
            tensor.zero_()
        return verdict

    def _wait_blocked(self, work, start: float, nbytes: int) -> None:
        """Wait for an all-reduce launched at ``start``, at least a round trip on links with
        software latency, and count the wait as blocked communication."""
        self._wait(work, "all-reduce", nbytes)
        remaining = start + self.min_collective_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self.stats.blocked_s += time.perf_counter() - start

    def _judge_table(self, rows: list[list[float]], out: frozenset[int]) -> Verdict:
        """``_judge`` on the check's summed table: a (norm, finite) row per rank."""
        return self._judge([r[0] for r in rows], [r[1] > 0.5 for r in rows], out)

    def _judge(self, norms: list[float], finite: list[bool], out: frozenset[int] | None = None) -> Verdict:
        """``comm.guard.judge`` on the group's contributions (rank order), counted by host, and
        this worker told where its own is left out. The ``left_out`` ranks (``out``: as they
        were when the contributions were sent) are left out as they are, neither judged (nor in
        the others' median) nor counted as rejected. Under a lock: DDP's buckets are judged on
        threads of their own, and the counts feed ``--max-rejections``."""
        with _JUDGING:
            return self._judge_locked(norms, finite, self.left_out if out is None else out)

    def _judge_locked(self, norms: list[float], finite: list[bool], out: frozenset[int]) -> Verdict:
        out = out if len(norms) == self.world_size else frozenset()
        norms = [0.0 if r in out else n for r, n in enumerate(norms)]  # 0: not in any median
        finite = [True if r in out else f for r, f in enumerate(finite)]
        verdict = judge(norms, finite, self.max_norm_ratio)
        for r in out:
            verdict.kept[r], verdict.reasons[r] = False, "left out: a copy of the leader's state"
        for r, kept in enumerate(verdict.kept):
            if r in out:
                continue
            self.step_checked.add(self._host(r))
            if not kept:
                self._rejected(r)
        if verdict.count and not verdict.kept[self.rank] and self.rank not in out:
            print(
                f"geotrain: this worker's contribution to an average was left out "
                f"({verdict.reasons[self.rank]}; --max-norm-ratio {self.max_norm_ratio:g})",
                file=sys.stderr,
                flush=True,
            )
        return verdict

    # -- the check, for codecs whose collective is not a mean all-reduce -------------------------
    @property
    def checking(self) -> bool:
        """Whether contributions are checked before they are averaged (``max_norm_ratio``, or an
        ``aggregate`` other than the plain mean)."""
        return self.max_norm_ratio > 0 or self._aggregate != "mean"

    @property
    def screening(self) -> bool:
        """Whether some contribution may be kept out of the average under way: checked, or a
        copy ``leaving_out`` leaves out. Codecs judge (``screen``, ``weigh_gathered``) where so."""
        return self.checking or bool(self.left_out)

    @property
    def aggregate_kind(self) -> tuple[str, int]:
        """``--aggregate`` parsed: (mean | clip | trimmed | median, f)."""
        return self._aggregate, self._trim

    def spoiled(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``--chaos corrupt`` for a codec that encodes before it sends: a corrupted copy of
        ``tensor`` where a corruption is due (None otherwise). The codec sends the copy and keeps
        its own state (error feedback, momentum) clean, as a worker whose message was spoiled on
        the way would."""
        if not self.corrupt_next or not tensor.is_floating_point():
            return None
        copy = tensor.detach().clone()
        corrupt_(copy, self.corrupt_next)
        self.corrupt_next = ""
        return copy

    def screen(self, tensor: torch.Tensor) -> Verdict | None:
        """The check before a codec's own collective (a reduce-scatter of quantised rows): the same
        verdict on every worker, ``tensor`` zeroed here where this worker's is left out (scaled
        down with ``clip``). None where nothing is checked."""
        if self.world_size == 1 or not self.screening:
            return None
        if not self.checking:  # only copies left out: no norms to exchange
            if self.rank in self.left_out:
                tensor.zero_()
            kept = [r not in self.left_out for r in range(self.world_size)]
            return Verdict(kept, ["" if k else "left out" for k in kept])
        return self._screen(tensor)

    def _host(self, rank: int) -> int:
        """The host of a group rank, where hosts are known (ranks change at a regroup)."""
        members = getattr(self.membership, "members", None)
        return members[rank] if members and len(members) == self.world_size else rank

    def _rejected(self, rank: int) -> None:
        """Count a contribution of ``rank`` left out by the check (``rejected_updates``)."""
        host = self._host(rank)
        self.rejected_by_rank[host] = self.rejected_by_rank.get(host, 0) + 1
        self.step_rejected.add(host)

    def check_shards(self, shards: torch.Tensor, verdict: Verdict) -> torch.Tensor:
        """The second phase of a sharded average (the quantised codecs: each worker averages one
        shard of every kept contribution, re-quantises it and all-gathers it): ``shards`` (one
        row per worker, decoded from the same bytes everywhere) checked against the bound the
        first phase's norms set (``Verdict.shard_bound``: 10 times what the kept contributions
        allow, whatever ``max_norm_ratio``). A shard that is not finite, or whose norm is above
        it, is zeroed (that part of the model gets no average this time, on every
        worker alike) and counted as its owner's rejection. No communication."""
        if not verdict.norms:
            return shards
        bound = verdict.shard_bound()
        for r in range(shards.shape[0]):
            norm, finite = message_norm(shards[r])
            if finite and norm <= bound:
                continue
            shards[r].zero_()
            self._rejected(r)
            host = self._host(r)
            said = f"{norm:.3g} > {bound:.3g}, what the contributions allow" if finite else "not finite"
            print(
                f"geotrain: host {host}'s shard of an average was left out (its norm {said})",
                file=sys.stderr,
                flush=True,
            )
        return shards

    def weigh_gathered(self, judged: list[tuple[float, bool]]) -> list[float]:
        """The check on contributions every worker already holds (an all-gather's messages,
        decoded; ``judged``: each one's ``guard.message_norm``, in rank order), with no
        communication: each one's weight in the mean. 0 where it is left out, else 1, or with
        ``clip`` the factor that brings it down to the median norm. Every worker computes the
        same weights from the same messages."""
        if not self.checking or len(judged) < 2:
            return [0.0 if r in self.left_out else 1.0 for r in range(len(judged))]
        norms, finite = [n for n, _ in judged], [ok for _, ok in judged]
        verdict = self._judge(norms, finite)
        limit = clip_norm(norms, verdict.kept) if self._aggregate == "clip" else float("inf")
        return [
            (min(1.0, limit / norm) if norm > 0 else 1.0) if kept else 0.0
            for norm, kept in zip(norms, verdict.kept, strict=True)
        ]

    def all_to_all(self, tensor: torch.Tensor, async_op: bool = False):
        """Split ``tensor`` (first dimension) into ``world_size`` equal parts and send part j to
        worker j; the result's part j came from worker j. Returns a ``Handle`` when ``async_op``.
        """
        launched = time.perf_counter()
        if self.world_size == 1:
            handle = Handle(self, None, tensor, 1, launched)
            return handle if async_op else handle.wait()
        if tensor.shape[0] % self.world_size:
            raise ValueError(f"all_to_all needs a first dimension divisible by {self.world_size}")
        nbytes = tensor.numel() * tensor.element_size()
        # The part addressed to oneself does not cross the link.
        wire = (self.world_size - 1) * nbytes // self.world_size
        self.stats.calls += 1
        self.stats.payload_bytes += nbytes
        self.stats.sent_bytes += wire
        self.stats.recv_bytes += wire
        out = torch.empty_like(tensor)
        work = dist.all_to_all_single(out, tensor, group=self.group, async_op=True)
        handle = Handle(self, work, out, 1, launched, "all-to-all", nbytes)
        return handle if async_op else handle.wait()

    def all_gather(self, tensor: torch.Tensor, async_op: bool = False):
        """Every worker's ``tensor`` (equal shapes), stacked in rank order (a ``Handle`` if async)."""
        launched = time.perf_counter()
        if self.world_size == 1:
            handle = Handle(self, None, tensor.unsqueeze(0), 1, launched)
            return handle if async_op else handle.wait()
        nbytes = tensor.numel() * tensor.element_size()
        # Ring all-gather: each worker forwards N-1 parts of this size.
        self.stats.calls += 1
        self.stats.payload_bytes += nbytes
        self.stats.sent_bytes += (self.world_size - 1) * nbytes
        self.stats.recv_bytes += (self.world_size - 1) * nbytes
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        work = dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=self.group, async_op=True)
        handle = Handle(self, work, out, 1, launched, "all-gather", nbytes)
        return handle if async_op else handle.wait()

    def all_gather_uneven(self, tensor: torch.Tensor, sizes: list[int], async_op: bool = False):
        """Every worker's 1-d ``tensor``, where worker j's has ``sizes[j]`` elements (known to all).

        One broadcast per worker, since the all-gather collective needs equal sizes.
        """
        launched = time.perf_counter()
        if self.world_size == 1:
            handle = Handle(self, None, [tensor], 1, launched)
            return handle if async_op else handle.wait()
        if tensor.numel() != sizes[self.rank]:
            raise ValueError(
                f"this worker's tensor has {tensor.numel()} elements, sizes says {sizes[self.rank]}"
            )
        itemsize = tensor.element_size()
        self.stats.calls += 1
        self.stats.payload_bytes += tensor.numel() * itemsize
        self.stats.sent_bytes += (self.world_size - 1) * sizes[self.rank] * itemsize
        self.stats.recv_bytes += (sum(sizes) - sizes[self.rank]) * itemsize
        parts = [
            tensor.contiguous() if j == self.rank else tensor.new_empty(size) for j, size in enumerate(sizes)
        ]
        # group_src: j is a rank in this communicator's group, which need not be the default one
        works = [
            dist.broadcast(part, group_src=j, group=self.group, async_op=True) for j, part in enumerate(parts)
        ]
        handle = Handle(self, works, parts, 1, launched, "all-gather", sum(sizes) * itemsize)
        return handle if async_op else handle.wait()

    def send_async(self, tensor: torch.Tensor, dst: int) -> Handle:
        """Point-to-point send to group rank ``dst`` (snapshot redundancy, restores)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.calls += 1
        self.stats.payload_bytes += nbytes
        self.stats.sent_bytes += nbytes
        work = dist.isend(tensor.contiguous(), group_dst=dst, group=self.group)
        return Handle(self, work, tensor, 1, time.perf_counter(), "send", nbytes)

    def recv_async(self, tensor: torch.Tensor, src: int) -> Handle:
        """Point-to-point receive from group rank ``src`` into ``tensor``."""
        self.stats.recv_bytes += tensor.numel() * tensor.element_size()
        work = dist.irecv(tensor, group_src=src, group=self.group)
        return Handle(
            self, work, tensor, 1, time.perf_counter(), "receive", tensor.numel() * tensor.element_size()
        )

    def probe_broadcast_s(self, nbytes: int, device: torch.device | None = None) -> list[float]:
        """Seconds for each worker in turn to broadcast ``nbytes`` from ``device`` (default the
        CPU: under NCCL, gloo's half of the group) to the others (the slowest receiver's view).

        A measurement of each worker's upload, on the control channel (not training traffic).
        """
        if self.world_size == 1:
            return [0.0]
        probe = torch.zeros(max(nbytes // 4, 1), device=device)
        cuda = probe.device.type == "cuda"
        mine = [0.0] * self.world_size
        for j in range(self.world_size):
            self.barrier()
            start = time.perf_counter()
            self._wait(
                dist.broadcast(probe, group_src=j, group=self.group, async_op=True), "link probe", nbytes
            )
            if cuda:
                torch.cuda.synchronize(probe.device)  # NCCL's wait only orders the stream
            mine[j] = time.perf_counter() - start
        self.control_calls += self.world_size
        # A broadcast is done when its slowest receiver has it.
        return self.max_scalars(mine)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank ``src``'s tensor to every worker (counted as ``payload`` once per receiver)."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.calls += 1
        self.stats.payload_bytes += nbytes
        if self.rank == src:
            self.stats.sent_bytes += nbytes
        else:
            self.stats.recv_bytes += nbytes
        self._wait(
            dist.broadcast(tensor, group_src=src, group=self.group, async_op=True), "broadcast", nbytes
        )
        self.stats.blocked_s += time.perf_counter() - start
        return tensor

    def mean_scalars(self, values: list[float]) -> list[float]:
        """Average a few numbers (validation losses, timings) over a control channel.

        Not part of the training traffic, so it is counted in ``control_calls`` only.
        """
        if self.world_size == 1:
            return list(values)
        self.control_calls += 1
        t = torch.tensor(values, dtype=torch.float64)
        self._wait(
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
            "all-reduce",
            8 * len(values),
        )
        return (t / self.world_size).tolist()

    def mean_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` in place over the group, as control traffic: counted in
        ``control_calls``, not in the training bytes and time (a measurement, such as scoring the
        replicas' mean model, not part of any algorithm)."""
        if self.world_size == 1:
            return tensor
        self.control_calls += 1
        self._wait(
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
            "all-reduce",
            tensor.numel() * tensor.element_size(),
        )
        return tensor.div_(self.world_size)

    def same_everywhere(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is bitwise the same on every worker, for the price of two floats:
        52 bits of its digest, exact in the control channel's float64, equal everywhere iff their
        max equals their min (and a wait that gives up when a member is lost)."""
        if self.world_size == 1:
            return True
        digest = hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()).digest()
        mine = float(int.from_bytes(digest[:8], "little") >> 12)
        most, least = self.max_scalars([mine, -mine])
        return most == -least

    def max_scalars(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        self.control_calls += 1
        t = torch.tensor(values, dtype=torch.float64)
        self._wait(
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
            "all-reduce",
            8 * len(values),
        )
        return t.tolist()

    def all_gather_object(self, obj):
        """Every worker's picklable ``obj`` in rank order (control traffic: restores, agreement).
        On gloo in two all-gathers (sizes, then the padded pickles) whose waits, like a
        collective's, give up once an epoch that lost members is published: a member lost
        during a regroup's agreement must not hold the others for the collective timeout."""
        if self.world_size == 1:
            return [obj]
        self.control_calls += 1
        if "gloo" not in str(dist.get_backend(self.group)):  # NCCL alone: torch's own, on the device
            out = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
            return out
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(dist.all_gather(sizes, mine, group=self.group, async_op=True), "all-gather", 8)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(rows, buf, group=self.group, async_op=True), "all-gather", longest)
        return [pickle.loads(row[: int(n)].numpy().tobytes()) for row, n in zip(rows, sizes, strict=True)]

    def barrier(self) -> None:
        if self.world_size > 1:
            self.control_calls += 1
            self._wait(dist.barrier(group=self.group, async_op=True), "barrier", 0)

    def exchange(
        self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]
    ) -> None:
        """Point-to-point transfers, all in flight at once: ``(tensor, peer rank, tag)`` each. A
        message between two workers is told from the others between them by its tag. Abandoned,
        like a collective, once an epoch that lost members is published (``wait_transfers``)."""
        if self.world_size == 1 or not (sends or recvs):
            return
        start = time.perf_counter()

        def peer(r: int) -> int:
            return r if self.group is None else dist.get_global_rank(self.group, r)

        works = [dist.isend(t, peer(r), group=self.group, tag=tag) for t, r, tag in sends]
        works += [dist.irecv(t, peer(r), group=self.group, tag=tag) for t, r, tag in recvs]
        self.stats.calls += 1
        for t, _, _ in sends:
            self.stats.payload_bytes += t.numel() * t.element_size()
            self.stats.sent_bytes += t.numel() * t.element_size()
        for t, _, _ in recvs:
            self.stats.recv_bytes += t.numel() * t.element_size()
        nbytes = sum(t.numel() * t.element_size() for t, _, _ in [*sends, *recvs])
        with self.naming_timeouts("point-to-point transfer", nbytes):
            wait_transfers(works, self.interrupt_after_now())
        self.stats.blocked_s += time.perf_counter() - start

    def _wait(self, work, op: str, nbytes: int) -> None:
        with self.naming_timeouts(op, nbytes):
            wait_work(work, self.interrupt_after_now(), not self.nccl)

    def interrupt_after_now(self) -> Callable[[], bool] | None:
        """True once an epoch newer than the current one loses members (None: never). An epoch
        that admits a joiner interrupts nothing: the group in use is healthy."""
        membership = self.membership
        if membership is None:
            return None
        epoch = membership.epoch
        return lambda: membership.published_leave > epoch
