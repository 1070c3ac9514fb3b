"""The link matrix: how fast each pair of hosts talks, measured at start-up, and the sites it shows.

``--hierarchy auto`` (issue 14; FusionLLM groups devices by measured bandwidth, arXiv 2410.12707)
finds the sites itself instead of being told them (``--topology``, ``--sites``):

1. **Measure.** Every pair of hosts exchanges a probe of ``PROBE_BYTES`` each way, in N-1 rounds
   of disjoint pairs (N for an odd N; the circle method of a round-robin tournament), each pair
   once untimed and twice timed, keeping the best. Pairs of a round run at once,
   so two that cross the same uplink share it, as the training traffic will.
2. **Group.** The pairs' speeds sorted, the widest gap between neighbours splits them into fast
   and slow links, where it is at least ``SPLIT`` wide; hosts joined by fast links are a site
   (connected components). With no such gap all hosts are one site and the all-reduce stays flat.

The matrix and the sites it gives are the same on every rank (one all-gather of the measurements).

3. **Place joiners.** A host admitted later (a spare, a replacement) measures its links to the
   members the same way (``joiner_rounds``) and goes into the site it reaches at least ``SPLIT``
   times faster than any other, else a site of its own (``site_of_joiner``;
   ``Communicator._place_joiners`` runs it at the regroup).
"""

from __future__ import annotations

import time

import torch

PROBE_BYTES = 256 * 1024  # 0.2 s each way at 10 Mbit/s, a sustained transfer at 1 Gbit/s
SPLIT = 8.0  # the least gap between slow and fast links that splits hosts into sites


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``n`` ranks once, in rounds of disjoint pairs (the circle method)."""
    ranks = list(range(n)) + ([-1] if n % 2 else [])  # -1: the bye of an odd count
    m = len(ranks)
    out = []
    for _ in range(m - 1):
        pairs = [(ranks[i], ranks[m - 1 - i]) for i in range(m // 2)]
        out.append([(min(a, b), max(a, b)) for a, b in pairs if a >= 0 and b >= 0])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]  # rotate all but the first
    return out


def joiner_rounds(joiners: list[int], members: list[int]) -> list[list[tuple[int, int]]]:
    """Every joiner paired with every member once, in rounds of disjoint pairs: joiner ``i`` of a
    batch of at most ``len(members)`` meets member ``(i + k) % M`` in round ``k``."""
    out = []
    m = len(members)
    for start in range(0, len(joiners), m):
        batch = joiners[start : start + m]
        out += [[tuple(sorted((j, members[(i + k) % m]))) for i, j in enumerate(batch)] for k in range(m)]
    return out


def measure(
    comm, nbytes: int = PROBE_BYTES, repeats: int = 2, schedule: list[list[tuple[int, int]]] | None = None
) -> list[list[float]]:
    """Bytes per second between each pair of ranks of ``comm``'s group (the diagonal: inf; a pair
    ``schedule`` leaves out: 0): the best of ``repeats`` timed exchanges after an untimed one
    (connections and buffers warm), so one slow moment does not decide. Collective: every rank
    calls it at the same point. The transfers go through ``comm.exchange``, so a member lost
    meanwhile ends them like a collective (a regroup measures joiners)."""
    n = comm.world_size
    speed = [0.0] * n
    speed[comm.rank] = float("inf")
    probe = torch.zeros(nbytes // 4)
    inbox = torch.empty_like(probe)
    for pairs in rounds(n) if schedule is None else schedule:
        for a, b in pairs:
            if comm.rank not in (a, b):
                continue
            peer = b if comm.rank == a else a
            for attempt in range(repeats + 1):
                start = time.perf_counter()
                if comm.rank == a:  # a sends first, then b: one exchange each way
                    comm.exchange([(probe, peer, 0)], [])
                    comm.exchange([], [(inbox, peer, 0)])
                else:
                    comm.exchange([], [(inbox, peer, 0)])
                    comm.exchange([(probe, peer, 0)], [])
                if attempt:  # the first exchange warms up, untimed
                    speed[peer] = max(speed[peer], 2 * nbytes / (time.perf_counter() - start))
        comm.barrier()  # the next round starts together, so only a round's own pairs share links
    rows = comm.all_gather_object(speed)
    # Each pair timed the same exchange from both ends: take the mean, so the matrix is symmetric.
    return [[(rows[i][j] + rows[j][i]) / 2 for j in range(n)] for i in range(n)]


def site_of_joiner(
    speeds: list[float], sites: list[int], split: float = SPLIT
) -> tuple[int | None, dict[int, float]]:
    """The site of a host that joins a run with sites: the one whose members it reaches fastest
    (``speeds`` to each member, ``sites`` theirs), where that is at least ``split`` times faster
    than any other site; None where no site is (its links to all are alike: a site of its own).
    With the fastest link to each site."""
    best: dict[int, float] = {}
    for site, speed in zip(sites, speeds, strict=True):
        best[site] = max(best.get(site, 0.0), speed)
    ranked = sorted(best.values(), reverse=True)
    if len(ranked) < 2 or ranked[0] < split * ranked[1]:
        return None, best
    return max(best, key=best.__getitem__), best


def sites_from(matrix: list[list[float]], split: float = SPLIT) -> list[int]:
    """The site of each rank: connected components of the fast links, numbered in order of their
    first rank. Fast and slow are told apart by the widest gap between the pairs' sorted speeds,
    and only where that gap is at least ``split`` (else all one site): one pair measured a little
    fast on a uniform cluster must not invent a site."""
    n = len(matrix)
    pairs = sorted(matrix[i][j] for i in range(n) for j in range(i + 1, n))
    if len(pairs) < 2:
        return [0] * n
    gap, k = max((pairs[k + 1] / pairs[k], k) for k in range(len(pairs) - 1))
    if gap < split:
        return [0] * n
    threshold = pairs[k + 1]  # the slowest of the fast links
    site = [-1] * n
    count = 0
    for start in range(n):
        if site[start] >= 0:
            continue
        site[start], todo = count, [start]
        while todo:
            i = todo.pop()
            for j in range(n):
                if site[j] < 0 and j != i and matrix[i][j] >= threshold:
                    site[j] = count
                    todo.append(j)
        count += 1
    # One site, or sites of one host each (no fast link anywhere): two levels would be one.
    return site if 1 < count < n else [0] * n
