"""Two-level all-reduce (sum inside each site over its LAN, across sites in stripes, then share)
and all-gather.

On sites joined by slow uplinks (``netem/topology.py``), a flat ring all-reduce of M bytes pushes
``2 (N-1)/N M`` through each site boundary the ring crosses, funnelled through one host's link at
each crossing. The two-level sum (issue 14; FusionLLM's grouping by measured bandwidth, arXiv
2410.12707; the hierarchical all-reduce of Horovod and NCCL's tree of rings) moves less across the
WAN and spreads it over every member of a site:

1. **inside** each site, an all-reduce over its LAN: every member holds the site's sum;
2. **across** sites, the vector cut into K stripes (K = the largest site's size): stripe j is
   all-reduced among one carrier per site (member ``j mod k_s`` of a site of ``k_s``), so a
   site's members carry its stripes side by side, ``2 (S-1)/S M`` across each uplink in all;
3. **inside** again: each member zeroes the stripes it did not carry and the site all-reduces,
   so every member ends with every stripe of the total (adding zeros is exact: all replicas end
   bitwise equal).

With two sites of two hosts, the WAN carries M per uplink instead of a ring's 1.5 M; with sites
of four, M instead of 1.75 M. The price is two LAN all-reduces. The groups are made with
``dist.new_group`` on the current default group (every rank makes every group, in the same
order, as torch requires), so they are remade with each membership epoch.

The three phases run one after another in a worker thread of the communicator (``Chain``), in
the order the collectives were launched, which is the same on every rank: an async all-reduce
launched during backward (DreamDDP, the bucketed S-SGD) overlaps compute as a flat one does.

**Two-level all-gather** (SparseLoCo's and DeMo's messages, which cannot be summed on the way):
where every site has the same number of hosts k, member j of each site all-gathers its own
message with member j of every other site (the stripe-j carriers), then each site all-gathers
over its LAN what its members carried. Each message crosses each uplink once, carried by its own
host: (S-1) messages out of a site per member, where a flat ring all-gather of N = S k hosts
pushes N-1 of them through each boundary it crosses, one host's link at a time (2x2: 2 per
uplink against 3; 2x4: 4 against 7). Sites of unequal size gather flat (``SiteGroups.even``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from geotrain.ft.membership import FORMATION_S, formed_group


@dataclass
class SiteGroups:
    """This rank's view of the two levels: its site's group, and the stripes it carries with
    the group of each stripe's carriers (one per site)."""

    site_of_rank: list[int]
    intra: Any  # the site's process group (None: a site of one)
    carried: list[tuple[int, Any]]  # (stripe, its carriers' group)
    stripes: int
    rank: int

    @property
    def sites(self) -> int:
        return len(set(self.site_of_rank))

    @property
    def site_size(self) -> int:
        return self.site_of_rank.count(self.site_of_rank[self.rank])

    @property
    def even(self) -> bool:
        """Every site has the same number of hosts: a message's carrier is its own host."""
        return len({self.site_of_rank.count(s) for s in set(self.site_of_rank)}) == 1

    def gather_wire_bytes(self, nbytes: int) -> tuple[int, int]:
        """(LAN, WAN) bytes this rank sends in a two-level all-gather of ``nbytes`` per rank:
        its message to the S-1 other sites' carriers (a ring among them), then the S messages
        it carried to its k-1 site-mates."""
        k, s = self.site_size, self.sites
        return (k - 1) * s * nbytes, (s - 1) * nbytes

    def member_ranks(self) -> list[list[int]]:
        """The ranks of each site (sites in order), members in rank order."""
        sites = sorted(set(self.site_of_rank))
        return [[r for r, x in enumerate(self.site_of_rank) if x == s] for s in sites]

    def wire_bytes(self, numel: int, element_size: int) -> tuple[int, int]:
        """(LAN, WAN) bytes this rank sends for an all-reduce of ``numel`` elements, by the ring
        formula of each phase: two LAN all-reduces, and its stripes' all-reduces across sites."""
        k, s, nbytes = self.site_size, self.sites, numel * element_size
        lan = 2 * (2 * (k - 1) * nbytes // k) if k > 1 else 0
        base, extra = divmod(numel, self.stripes)  # tensor_split's sizes: the first ``extra`` one larger
        sizes = [base + (j < extra) for j in range(self.stripes)]
        wan = sum(2 * (s - 1) * sizes[j] * element_size // s for j, _ in self.carried)
        return lan, wan


def site_groups(
    site_of_rank: list[int], rank: int, timeout_s: float, formation_s: float = FORMATION_S
) -> SiteGroups | None:
    """Make the two levels' groups for ranks in ``site_of_rank`` (the site of each rank of the
    current default group). Collective: every rank calls it at the same point. None where two
    levels would be one: a single site, or sites of one host each.

    Each group is made under a timeout of at most ``formation_s`` (``ft.membership.formed_group``;
    at start-up the communicator gives the whole timeout, as peers may still be loading), then
    given ``timeout_s`` for its collectives: a member lost while a regroup makes them fails the
    others here within a minute, and they regroup again."""
    sites = sorted(set(site_of_rank))
    members = {s: [r for r, site in enumerate(site_of_rank) if site == s] for s in sites}
    if len(sites) < 2 or all(len(m) == 1 for m in members.values()):
        return None

    def new_group(ranks: list[int]):
        return formed_group(ranks, timeout_s, formation_s)  # its collectives: the whole timeout

    intra = None
    for s in sites:  # every rank makes every group, in the same order
        group = new_group(members[s])
        if rank in members[s] and len(members[s]) > 1:
            intra = group
    stripes = max(len(m) for m in members.values())
    carried = []
    for j in range(stripes):
        carriers = [members[s][j % len(members[s])] for s in sites]
        group = new_group(carriers)
        if rank in carriers:
            carried.append((j, group))
    return SiteGroups(list(site_of_rank), intra, carried, stripes, rank)


def two_level_sum_(flat: torch.Tensor, groups: SiteGroups) -> torch.Tensor:
    """Sum the 1-d contiguous ``flat`` over every rank, in place, in two levels (blocking)."""
    if groups.intra is not None:
        dist.all_reduce(flat, group=groups.intra)
    stripes = torch.tensor_split(flat, groups.stripes)
    mine = set()
    for j, group in groups.carried:
        dist.all_reduce(stripes[j], group=group)
        mine.add(j)
    if groups.intra is not None:
        for j, stripe in enumerate(stripes):
            if j not in mine:
                stripe.zero_()
        dist.all_reduce(flat, group=groups.intra)
    return flat


def two_level_gather(tensor: torch.Tensor, out: torch.Tensor, groups: SiteGroups) -> torch.Tensor:
    """Every rank's ``tensor`` into ``out`` ((N, ...), rank order), in two levels (blocking).
    Sites of equal size only (``SiteGroups.even``): member i of each site carries its own
    message across, to member i of every other site; then each site shares over its LAN what
    its members carried."""
    sites = groups.member_ranks()
    ((_, carriers),) = groups.carried  # sites of equal size: one stripe per member, its own
    across = torch.empty((len(sites), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(across.unbind(0)), tensor.contiguous(), group=carriers)
    # (sites of one host each make no groups: ``intra`` is there)
    carried = torch.empty((groups.site_size, *across.shape), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(carried.unbind(0)), across, group=groups.intra)
    # carried[i]: what member i of this site carried, in its carriers' group's order (their ranks
    # sorted, as torch orders a group's ranks); the site's members are in rank order too
    for i in range(len(carried)):
        order = sorted(members[i] for members in sites)
        for members in sites:
            out[members[i]].copy_(carried[i][order.index(members[i])])
    return out


class ChainWork:
    """A collective run by a ``Chain``: ``is_completed``/``wait`` as a torch ``Work``, so the
    communicator's waits (and their membership polls) treat it like any other."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("the two-level collective is still running")  # as gloo's timed-out wait
        if self._error is not None:
            raise self._error
        return True

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class Chain:
    """One thread that runs two-level all-reduces and all-gathers in the order they were launched.

    After one fails, every later one fails with the same error without running: its phases would
    otherwise pair with a peer's phases of another job on a healthy site group (a member whose
    stripe failed starting the next job's LAN sum while its site-mate still waits in this one's)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="geotrain-two-level", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> ChainWork:
        if self._closed:
            raise RuntimeError("the two-level chain is closed (its communicator was rebound or closed)")
        work = ChainWork()
        self._jobs.put((job, work))
        return work

    def _run(self) -> None:
        while True:
            job, work = self._jobs.get()
            if job is None:
                return
            if self._broken is not None:
                work._finish(self._broken)
            else:
                try:
                    with torch.no_grad():  # a caller's no_grad does not reach this thread
                        job()
                except BaseException as e:  # handed to whoever waits on it, and to every later job
                    self._broken = e
                    work._finish(e)
                else:
                    work._finish(None)
            job = work = None  # the job's tensors and groups are not kept alive while idle

    def close(self, wait_s: float = 0.0) -> None:
        """Stop after the jobs already submitted (one stuck on a lost peer is left: daemonic)."""
        if not self._closed:
            self._closed = True
            self._jobs.put((None, None))
        if wait_s:
            self._thread.join(wait_s)
