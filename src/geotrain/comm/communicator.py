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

Beside it: ``comm/waits.py`` (the ``Handle`` of a collective in flight, waits that give up once
the group loses a member, one line naming a collective that timed out or lost its peer) and
``comm/checked.py`` (the check of contributions before they are averaged, mixed into
``Communicator``). What moved there is importable from here as before.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
import time
from collections.abc import Callable, MutableSequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.checked import CheckedMeans, corrupt_
from geotrain.comm.digest import bytes_digest
from geotrain.comm.guard import GATHERED, parse_aggregate
from geotrain.comm.hierarchy import Chain, SiteGroups, site_groups, two_level_gather, two_level_sum_

# The names marked F401 are used in waits.py only since the split: importable from here as before
from geotrain.comm.waits import (
    INTERRUPT_POLL,  # noqa: F401
    NCCL_POLL_S,  # noqa: F401
    TIMEOUT_MARK,  # noqa: F401
    CollectiveTimeout,
    Handle,
    Unposted,
    is_timeout,
    peer_lost_line,  # noqa: F401
    timeout_line,  # noqa: F401
    timeout_message,
    wait_transfers,
    wait_work,
)
from geotrain.ft.membership import (
    FORMATION_S,
    MembershipChanged,
    retire,
)


@dataclass
class CommStats:
    """Cumulative accounting; ``delta`` gives the part since a snapshot (one training step)."""

    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    blocked_s: float = 0.0
    wan_sent_bytes: int = 0  # of sent_bytes, what crossed sites (two-level all-reduces and gathers only)

    def copy(self) -> CommStats:
        return CommStats(**asdict(self))

    def delta(self, since: CommStats) -> CommStats:
        return CommStats(**{k: getattr(self, k) - getattr(since, k) for k in asdict(self)})

    def as_dict(self) -> dict:
        return asdict(self)


# A smaller all-gather goes flat even across sites: it is a control figure (``--pace time``'s, a
# snapshot's sizes), latency-bound (two levels are two round trips), and must not queue on the
# two-level chain behind a message in flight there.
TWO_LEVEL_GATHER_BYTES = 4096


@dataclass
class Communicator(CheckedMeans):
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
    # The process group's timeout: for the message when one expires, and what a send or receive
    # waits (``wait_timeout``)
    timeout_s: float = 0.0
    link: str = ""  # the links, described, for the same message
    # The site of each host: all-reduces over the default group go in two levels, and all-gathers
    # where sites are of equal size (comm/hierarchy.py)
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
        self.corrupt_stamp = False  # the same for the owners' stamp on its copies (owners=2)
        # owners that sent a stream's copies under a stray stamp since the last regroup
        self.stamp_strays: dict[Any, set[int]] = {}
        self.rejected_by_rank: dict[int, int] = {}  # contributions left out, by group rank
        # shards of a mean whose two owners disagreed (a quantised codec's owners=2), by host pair
        self.disputed_shards: dict[tuple[int, int], int] = {}
        # This step's verdicts by host (train.py counts rejections per step for --max-rejections)
        self.step_checked: set[int] = set()
        self.step_rejected: set[int] = set()
        # Those of them judged at a landing of a message in flight (``judging_a_landing``): kept
        # through a regroup, where the rest of a step cut short is redone (``forget_cut_verdicts``)
        self.landing_checked: set[int] = set()
        self.landing_rejected: set[int] = set()
        # Ranks whose contributions the averages under way leave out, known alike on every
        # worker (``leaving_out``: an average redone after a regroup, where they hold copies of
        # the leader's state): they send zeros and the mean is over the others.
        self.left_out: frozenset[int] = frozenset()
        self.two_level: SiteGroups | None = None
        self._chain: Chain | None = None
        # A checked mean's buffers (its message and the table, ``_checked_mean``), by size, kept
        # for the next step's: a fresh one per bucket is fresh memory the kernel must fault in
        # and zero, page by page (on W1 the check cost ssgd 3.5% of its step with fresh ones,
        # 1.0% with these).
        self._spare_buffers: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.rebind(self.group)

    def rebind(self, group: dist.ProcessGroup | None) -> None:
        """Talk over ``group`` from now on (a new membership epoch's group; None: the default).
        With sites, collective: the two levels' groups are made for the new members."""
        self.group = group
        self.stamp_strays = {}  # a new group: each may stray once again (CheckedMeans.count_strays)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        # NCCL carries the CUDA tensors (gloo, in the same group, the CPU control numbers)
        self.nccl = self.distributed and "nccl" in str(dist.get_backend(self.group))
        self.max_norm_ratio = self.ratio_for(self.world_size)
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
        # The table's rows follow the group's size: the old group's sizes are not taken again.
        self._spare_buffers = {}
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

    def all_to_all(self, tensor: torch.Tensor, async_op: bool = False, control_bytes: int = 0):
        """Split ``tensor`` (first dimension) into ``world_size`` equal parts and send part j to
        worker j; the result's part j came from worker j. Returns a ``Handle`` when ``async_op``.
        ``control_bytes`` of each part are the check's (``norm_bytes``), not counted: control
        traffic, as the table a checked mean carries is not."""
        launched = time.perf_counter()
        if self.world_size == 1:
            handle = Handle(self, None, tensor, 1, launched)
            return handle if async_op else handle.wait()
        if tensor.shape[0] % self.world_size:
            raise ValueError(f"all_to_all needs a first dimension divisible by {self.world_size}")
        nbytes = tensor.numel() * tensor.element_size() - self.world_size * control_bytes
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

    def all_gather(self, tensor: torch.Tensor, async_op: bool = False, control_bytes: int = 0):
        """Every worker's ``tensor`` (equal shapes), stacked in rank order (a ``Handle`` if async).
        Its last ``control_bytes`` are the check's, not counted (as ``all_to_all``'s)."""
        launched = time.perf_counter()
        if self.world_size == 1:
            handle = Handle(self, None, tensor.unsqueeze(0), 1, launched)
            return handle if async_op else handle.wait()
        nbytes = tensor.numel() * tensor.element_size() - control_bytes
        self.stats.calls += 1
        self.stats.payload_bytes += nbytes
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        groups = self.two_level
        two_level = groups is not None and groups.even and self._chain is not None
        if two_level and nbytes >= TWO_LEVEL_GATHER_BYTES:
            # In two levels (comm/hierarchy.py): each message crosses each uplink once, carried
            # by its own host; on the chain, in launch order with the two-level sums.
            lan, wan = groups.gather_wire_bytes(nbytes)
            self.stats.sent_bytes += lan + wan
            self.stats.recv_bytes += lan + wan
            self.stats.wan_sent_bytes += wan
            mine = tensor.contiguous()
            work = self._chain.submit(lambda: two_level_gather(mine, out, groups))
        else:
            # Ring all-gather: each worker forwards N-1 parts of this size.
            self.stats.sent_bytes += (self.world_size - 1) * nbytes
            self.stats.recv_bytes += (self.world_size - 1) * nbytes
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
        return self._transfer(
            dist.isend(tensor.contiguous(), group_dst=dst, group=self.group), tensor, "send"
        )

    def recv_async(self, tensor: torch.Tensor, src: int) -> Handle:
        """Point-to-point receive from group rank ``src`` into ``tensor``."""
        self.stats.recv_bytes += tensor.numel() * tensor.element_size()
        return self._transfer(dist.irecv(tensor, group_src=src, group=self.group), tensor, "receive")

    def _transfer(self, work, tensor: torch.Tensor, op: str) -> Handle:
        """A send's or receive's handle: waited on as ``exchange``'s are, under ``wait_timeout``."""
        nbytes = tensor.numel() * tensor.element_size()
        timeout = self.wait_timeout(tensor)
        return Handle(self, work, tensor, 1, time.perf_counter(), op, nbytes, transfer=True, timeout=timeout)

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
        mine = float(int.from_bytes(bytes_digest(tensor, 8), "little") >> 12)
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
        self,
        sends: list[tuple[torch.Tensor, int, int]],
        recvs: list[tuple[torch.Tensor, int, int]],
        received: MutableSequence[bool] | None = None,
    ) -> None:
        """Point-to-point transfers: ``(tensor, peer rank, tag)`` each; with a membership, those on
        the CPU posted a window at a time (``wait_transfers``: gloo sends a message once its
        receive is posted, and a transfer abandoned goes on over the retired group). A message
        between two workers is told from the others between them by its tag, and both list the
        messages between them in the same order (each side posts a window at a time, in its
        list's order). Abandoned, like a collective, once an epoch that lost members is
        published (``wait_transfers``).
        ``received``: one flag per receive, set as it completes, also after the exchange was
        abandoned (the messages from each peer are waited on in order, apart from the others')."""
        if self.world_size == 1 or not (sends or recvs):
            return
        start = time.perf_counter()
        works, nbytes = self._post(sends, recvs)
        lanes = [2 * r for _, r, _ in sends] + [2 * r + 1 for _, r, _ in recvs]  # (peer, direction)
        first = len(sends)

        def done(i: int) -> None:
            if received is not None and i >= first:
                received[i - first] = True

        with self.naming_timeouts("point-to-point transfer", nbytes):
            timeout = self.wait_timeout(*(t for t, _, _ in [*sends, *recvs]))
            wait_transfers(works, self.interrupt_after_now(), timeout, lanes, done)
        self.stats.blocked_s += time.perf_counter() - start

    def send_later(self, sends: list[tuple[torch.Tensor, int, int]]) -> PostedSends:
        """Point-to-point sends left to gloo and a thread of their own, which posts them and waits
        for them: a joiner's hand-over while the members train on (``ft/handover.py``).
        ``finish()`` waits for that thread (abandoned as ``exchange`` is, once an epoch that lost
        members is published after this call)."""
        works, nbytes = self._post(sends, []) if self.world_size > 1 and sends else ([], 0)
        timeout = self.wait_timeout(*(t for t, _, _ in sends))
        return PostedSends(self, works, [r for _, r, _ in sends], nbytes, timeout)

    def _post(self, sends, recvs) -> tuple[list, int]:
        """``isend``/``irecv`` each, counted: the works and their bytes."""

        def peer(r: int) -> int:
            return r if self.group is None else dist.get_global_rank(self.group, r)

        # The group itself, not None: a transfer posted later goes on this group or fails, never
        # on the default group of the next epoch. On the CPU (gloo), with a membership, each is
        # posted a window at a time (wait_transfers); a send of a slice as a copy of it, so that
        # those left pending on a retired group (their receives never posted) hold their chunks,
        # not the whole state.
        group = self.group if self.group is not None else dist.group.WORLD

        def transfer(t: torch.Tensor, r: int, tag: int, receive: bool):
            if receive:
                post = partial(dist.irecv, t, peer(r), group=group, tag=tag)
            else:  # a copy where a window may leave it pending on a retired group
                post = partial(_isend_copy, t, peer(r), group, tag, self.membership is not None)
            return Unposted(post, t.numel() * t.element_size(), receive) if t.device.type == "cpu" else post()

        works = [transfer(*s, False) for s in sends] + [transfer(*r, True) for r in recvs]
        self.stats.calls += 1
        for t, _, _ in sends:
            self.stats.payload_bytes += t.numel() * t.element_size()
            self.stats.sent_bytes += t.numel() * t.element_size()
        for t, _, _ in recvs:
            self.stats.recv_bytes += t.numel() * t.element_size()
        return works, sum(t.numel() * t.element_size() for t, _, _ in [*sends, *recvs])

    def _wait(self, work, op: str, nbytes: int) -> None:
        with self.naming_timeouts(op, nbytes):
            wait_work(work, self.interrupt_after_now(), not self.nccl)

    def wait_timeout(self, *tensors: torch.Tensor) -> timedelta | None:
        """The timeout a send or receive of ``tensors`` is waited on with: the collective timeout
        where known, and the tensors go by gloo (on the CPU; NCCL's would abort its
        communicator when a timed wait expires); None: the group's own. gloo's would otherwise
        keep a regroup's formation bound (``waits.plain_wait``). Collectives follow the group's
        timeout (``_set_pg_timeout``) and are waited on plainly."""
        if not self.timeout_s or any(t.device.type != "cpu" for t in tensors):
            return None
        return timedelta(seconds=self.timeout_s)

    def interrupt_after_now(self) -> Callable[[], bool] | None:
        """True once an epoch newer than the current one loses members (None: never). An epoch
        that admits a joiner interrupts nothing: the group in use is healthy."""
        membership = self.membership
        if membership is None:
            return None
        epoch = membership.epoch
        return lambda: membership.published_leave > epoch


def _isend_copy(tensor: torch.Tensor, peer: int, group, tag: int, copy: bool = True):
    """``isend`` of ``tensor``, where ``copy`` and it is a slice on the CPU (a chunk of a
    hand-over's encoded state) of a copy of it, which the work holds until it is sent."""
    if copy and tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() > tensor.nbytes:
        tensor = tensor.clone()  # first: a failed send's traceback holds this frame, not the view
    return dist.isend(tensor, peer, group=group, tag=tag)


class PostedSends:
    """Sends of ``Communicator.send_later``: a thread of its own posts them (with a membership,
    a window at a time) and waits for them, each peer's in order, and drops each work once
    sent (with a membership; else all once all are), whose tensor gloo no longer needs."""

    def __init__(self, comm: Communicator, works: list, lanes: list[int], nbytes: int, timeout) -> None:
        self.comm, self.nbytes = comm, nbytes
        self.interrupt = comm.interrupt_after_now()
        self.failed: list[BaseException] = []
        self.finished = threading.Event()
        pending = [works]

        def waiter() -> None:
            try:  # a window at a time, abandoned as exchange's are (its chunks not sent dropped)
                wait_transfers(pending[0], self.interrupt, timeout, lanes)
            except BaseException as e:  # told by finish()
                self.failed.append(e)
            finally:
                pending.clear()  # sent (or failed): the tensors may go
                self.finished.set()

        threading.Thread(target=waiter, name="geotrain-posted-sends", daemon=True).start()

    def done(self) -> bool:
        return self.finished.is_set()

    def finish(self) -> None:
        start = time.perf_counter()
        with self.comm.naming_timeouts("point-to-point transfer", self.nbytes):
            while not self.finished.wait(0.05):
                if self.interrupt is not None and self.interrupt():
                    raise MembershipChanged("the group lost a member while a point-to-point transfer waited")
            if self.failed:
                raise self.failed[0]
        self.comm.stats.blocked_s += time.perf_counter() - start
