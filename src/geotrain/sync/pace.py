"""Periods measured in time for stragglers: ``--pace time`` (``localsgd``, ``diloco``; with
``--site-H`` too).

With one worker FACTOR times slower, a per-step method runs at its pace, and so does a periodic
one run by steps: at every sync the others wait for the straggler's H steps. A period measured
in time instead lets each worker do the inner steps it can in the time the fastest takes for H.
Worker r computes the first

    k_r = clamp(round(H * t_min / t_r), 1, H),   and k_r = H where t_r <= (1 + TOLERANCE) t_min,

of a period's H steps and skips the rest (no data, forward, backward or update: the step counter
alone moves, so every worker reaches the sync at the same step and the membership layer's
boundaries, snapshots and resume stay where they are). t_r is the median compute time of
worker r's steps that every worker computed (the first min_j k_j of each period) over the last
``WINDOW`` periods, t_min the fastest worker's. The average at the sync weighs
each worker by its tokens, k_r / sum_j k_j, so a straggler's shorter progress counts for what it
is: x <- sum_r k_r x_r / sum_j k_j (parameters, or pseudo-gradients under diloco and codecs).
Workers within ``TOLERANCE`` (10%) of the fastest keep every step: step times of equal machines
differ by a few percent from period to period (here, four workers sharing two cores measured
9 of 10 steps for two equal workers), and a step of tokens is worth more than the fastest
worker's few seconds of wait at the sync.

Every worker all-gathers one float per sync (its t_r) and computes every k_r from the same
numbers, so all agree on the weights, and on the tokens each step trains, without another
exchange. The first period, and the first after a change of members, runs with k_r = H on every
worker: nothing has been measured yet. Where every worker stays within the tolerance of the
fastest, the quotas stay H and the parameters are those ``--pace steps`` gives, bitwise (the
weights are exactly 1.0), for one more all-gather of a float per sync.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

PACES = ("steps", "time")
TOLERANCE = 0.1  # a worker this close to the fastest computes every step of the period
# t_r is the median of the steps timed in the last WINDOW periods (a period's few steps alone
# moved t_r of equal workers by half, period to period, on shared cores)
WINDOW = 4


class TimePace:
    """The quotas k_r of the period under way, and this worker's step times in it."""

    def __init__(self, H: int, comm) -> None:
        self.H = H
        self.comm = comm
        self.quotas = [H] * comm.world_size
        self._times: list[float] = []
        self._window: list[list[float]] = []  # the times of the last periods, oldest first
        self._started: float | None = None  # clock() at the start of a computed step
        self.clock = time.perf_counter  # tests set their own

    # -- the steps of a period -------------------------------------------------------------------
    def computes(self, index: int) -> bool:
        """Whether this worker computes the step at ``index`` (0-based) of its period; a computed
        step is timed from here to ``stepped``."""
        self._fit_group()
        computes = index < self.quotas[self.comm.rank]
        # Timed only where every worker computes: workers that share cores (or a host's
        # memory bandwidth) step faster in a period's last steps, once the others have stopped,
        # and the one that computes the most would read as the fastest (here 4 equal workers
        # on 2 cores, one 2x slower, settled at quotas [10, 3, 6, 7] of 10, timed over all).
        timed = computes and index < min(self.quotas)
        self._started = self.clock() if timed else None
        return computes

    def stepped(self) -> None:
        """The step ``computes`` asked about has been applied (before any sync it makes); its
        time counts where every worker computed it."""
        if self._started is not None:
            self._times.append(self.clock() - self._started)
            self._started = None

    def workers_computing(self, index: int) -> int:
        """How many workers compute the step at ``index`` of the period (the tokens it trains)."""
        self._fit_group()
        return sum(q > index for q in self.quotas)

    # -- the sync --------------------------------------------------------------------------------
    def weight(self, steps: int, since: int = 0, sites: list[int] | None = None) -> float:
        """This worker's factor in a sync ``steps`` steps into the period (H at its end; fewer
        at the end of a run): N c_r / sum c, c_r = min(k_r, steps) the steps worker r computed.
        The mean of the weighted contributions is then their token-weighted mean; the factor is
        exactly 1.0 where every worker computed as many.

        With ``--site-H`` (``sites``: each rank's site; ``since``: the period index of the site
        averages' last, 0 if none) each worker holds its site's token-weighted mean up to then
        plus its own steps since: the factor is N K_s t_r / (T_s K), K_s the steps site s
        computed in the period, t_r worker r's since the site average and T_s their sum over
        the site. So a site counts for its tokens, and inside it each worker's last steps for
        theirs: the result is what a site average at the sync, then a token-weighted average
        of the sites, would give (t_r / T_s is 1 / n_s where no one in the site computed
        since). Without sites (or since 0 and a site each) it is N k_r / sum k."""
        self._fit_group()
        rank, n = self.comm.rank, len(self.quotas)
        done = [min(q, steps) for q in self.quotas]
        tail = [d - min(q, since) for d, q in zip(done, self.quotas, strict=True)]
        if len(set(done)) == 1 and len(set(tail)) == 1:
            return 1.0  # bitwise the unpaced average
        sites = sites or list(range(n))
        site = [r for r in range(n) if sites[r] == sites[rank]]
        site_done, site_tail = sum(done[r] for r in site), sum(tail[r] for r in site)
        share = tail[rank] / site_tail if site_tail else 1 / len(site)
        return n * site_done * share / sum(done)

    def site_weight(self, start: int, end: int, sites: list[int]) -> float:
        """This worker's factor in a site average (``--site-H``) at period index ``end``, the
        last at ``start`` (0: the period's start): n_s t_r / T_s, t_r the steps worker r computed
        since and T_s their sum over its site, so that the site's mean is token-weighted; 1.0
        where every worker of the site computed as many (or none did: they are one model)."""
        self._fit_group()
        rank = self.comm.rank
        tail = [min(q, end) - min(q, start) for q in self.quotas]
        site = [r for r in range(len(sites)) if sites[r] == sites[rank]]
        if len({tail[r] for r in site}) == 1:
            return 1.0
        return len(site) * tail[rank] / sum(tail[r] for r in site)

    def exchange(self) -> list[int]:
        """At the sync, before its average: all-gather the period's median step time and return
        the next period's quotas (set them once the average has landed: a failed exchange
        changes nothing). t_r pools the steps timed in the last ``WINDOW`` periods (a median of
        the periods' medians measured worse: equal workers kept 8.6 of 10 steps against 9.0).
        A worker that has timed nothing since a change of members (or a restore) reports 0,
        which counts as unknown: the next period runs unpaced."""
        self._window = [*self._window[-(WINDOW - 1) :], self._times] if self._times else self._window
        timed = [t for period in self._window for t in period]
        mine = statistics.median(timed) if timed else 0.0
        gathered = self.comm.all_gather(torch.tensor([mine], dtype=torch.float64))
        self._times = []
        times = [float(t) for t in gathered.reshape(-1)]
        if not all(t > 0 for t in times):
            return [self.H] * len(times)
        fastest = min(times)
        return [
            self.H if t <= (1 + TOLERANCE) * fastest else max(1, min(self.H, round(self.H * fastest / t)))
            for t in times
        ]

    def reset(self) -> None:
        """A change of members: the next period starts unpaced, nothing measured."""
        self.quotas = [self.H] * self.comm.world_size
        self._times, self._window, self._started = [], [], None

    def _fit_group(self) -> None:
        if len(self.quotas) != self.comm.world_size:
            self.reset()

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"quotas": list(self.quotas)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.quotas = [int(q) for q in state["quotas"]]
        self._times, self._window, self._started = [], [], None
