"""``sparseloco``: SparseLoCo (Sarfi, Therien, Lidin, Belilovsky, arXiv 2508.15706).

DiLoCo's H local steps, then an outer step whose message is tiny. With theta the shared
parameters (the anchor, bitwise equal on every worker) and theta_r worker r's copy after H
inner steps:

    Delta_r = theta - theta_r                       (the pseudo-gradient)
    e_r    <- beta * e_r + Delta_r                  (error feedback, decayed)
    q_r     = Q(TopK_chunk(e_r))                    (k per chunk, ``bits``-bit values)
    e_r    <- e_r - q_r                             (what was not sent stays)
    theta  <- theta - alpha * mean_r(q_r)           (no outer momentum: e plays its part)

``mean_r`` is per entry: over the workers whose message holds it (``mean_over`` senders, the
reference code's ``scatter_reduce(reduce="mean", include_self=False)``), or over every worker
(workers: an entry a worker did not pick counts as its zero). ``auto`` (the default) takes
senders without overlap and workers with it (where the mean lands in a period's second half:
``tau`` below), each the better there on GPT ``tiny`` (4 workers,
H=20, final validation loss). Without overlap, over senders at alpha 1: 2.1432 / 2.4034 at 400
steps (seeds 0 / 1) and 1.5505 at 2,000, against 2.1909 / 2.4459 and 1.5874 over workers at
alpha 2 (alpha 1.5 over senders: 2.1430 / 2.3705 at 400 steps, but 1.6156 at 2,000, flat from
step 1,400). With overlap, 2.2304 over workers at alpha 2 against 2.3343 over senders at alpha
1 (2.2847 at 0.7), 400 steps.

``Q`` and ``TopK_chunk`` are ``geotrain.compress.chunked.ChunkTopK``; the q_r travel packed
(values in ``bits`` bits, indices in 12 bits for chunks of 4096) through one all-gather, so the
bytes counted are the bytes sent. Chunks are cut per tensor, as the paper's are
(``TensorChunks``: each parameter padded to whole chunks): on GPT ``tiny`` at 400 steps that
took the final loss from 2.2824 to 2.2262 (2.2491 to 2.1822 without overlap), for 1.6% more
bytes on ``mini``.

The period, ``H``: "auto" by default. The paper runs H=15 to 250; on GPT ``mini`` (W1: 4
workers, batch 8 x 128, 2,000 steps, no overlap) a shorter period learns more per token, at
bytes that stay small: H=20 needed about 1.26x DDP's tokens to DDP's loss, H=10 and H=5 fewer
(docs/frontier.md, "The period"). How short a period the link affords depends on it, so a run
times whole steps and one all-gather of its message at start-up (``prepare``) and takes, of
5, 10, 20 and 40, the period with the shortest predicted time to a loss: the step predicted
with the gather every H steps (synchronous, or overlapped as ``--overlap auto`` decides), times
1 + ``SPARSELOCO_PENALTY`` x H and, overlapped, the late landing's 1 + min(0.4 L / H, 0.24)
(``plan.gather.choose_sparseloco_period``). The slowest worker's
figures decide for all; the choice is saved with the run.

Defaults. The paper's: chunks of 4096 with k=64 (1.56% density), 2-bit values, beta 0.95, and
alpha 1. Ours keep them, alpha 1 over senders and 2 over workers (``alpha`` 0), best on our
workload (above; over workers with overlap, alpha 1 gave 2.40 and alpha 2 2.28 in an earlier
layout, k=128 2.24 for twice the bytes): a short run has few outer steps for the residual to
drain through. Measured and not taken (docs/frontier.md): chunks of 1024 with k=16 (within
0.8% either way, 5% fewer bytes on ``mini``), 4 or 8 bits (worse), and a Nesterov momentum on the
mean (worse by the end: e is the momentum already).
A message is 1/139 of DiLoCo's fp32 pseudo-gradient (GPT ``mini``); an all-gather among 4
workers sends 3 of them, 1/70 of what DiLoCo's all-reduce sends.

``overlap`` takes the outer step's all-gather off the critical path, with eager
updates (Kale et al. 2025, "Eager updates for overlapped communication and computation in
DiLoCo"): at sync k a worker launches the gather of its message q_k, lands the mean of the
messages of sync k-1 (gathered during the whole period since) in the anchor, and goes on from
theta - alpha * q_k, its own message standing in for the mean that is still in flight. The
anchors agree bitwise; the replicas differ by alpha times their own sparse message (a few % of
the entries) until the mean lands a period later. Measured on the workload above (k=128):
2.24 against 2.19 without overlap; at k=64, alpha 1 a one-period-late step without the eager part
gave 2.54 against 2.40 eager. ``finalize`` lands
the message in flight (and, inside a period, one last synchronous outer step for its steps), so
the run ends with one model.

``tau`` lands the mean sooner: ``tau`` steps into the next period rather than at its end. The
anchor takes the mean then, and the replica the same change as its start (new anchor - start:
the mean replaces this worker's own message, which stood in for it), so the rest of the period
trains from where a synchronous outer step would have put it; the next pseudo-gradient is still
the whole period's progress. The sooner it lands, the less the overlap costs. Measured on GPT
``tiny`` (4 workers, H=20, 400 steps, loopback, final validation loss; seed 0, seed 1 where
given; no overlap 2.1471 / 2.4041, landing a period late over workers at alpha 2 2.2305 /
2.4838): over senders at alpha 1, tau 1 2.1541, tau 3 2.1554 / 2.4231, tau 6 2.1846, tau 10
2.2576 (a period late: 2.3343); over workers at alpha 2, tau 3 2.1974 / 2.4593, tau 6 2.2105,
tau 10 2.2267. At 2,000 steps (seeds 0 / 1): no overlap 1.5395 / 1.7724, tau 3 over senders
1.5904 / 1.7590, a period late over workers 1.6099 / 1.8519. So ``mean_over`` auto takes
senders (alpha 1) where the mean lands in the period's first half, and workers (alpha 2) where
it lands later.

``overlap`` "auto" (the default) overlaps only where that reaches a loss sooner: the first
outer step runs synchronously and times its all-gather against the period's compute (H times
the median step interval before it), and every later step overlaps where the step it saves
outweighs the steps to a loss that its late landing costs (``plan.gather.weigh_overlap``: a
mean landing L of H steps late costs min(0.4 L / H, 0.24) more steps, measured on GPT ``tiny``;
a gather of 5% of the period overlaps at H=20, landing 2 steps late, and not at H=5, where it
lands a fifth of the period late), else none does, until the landing moves (below). (A fixed
5% of the period decided before: it overlapped on ``tiny`` at H=5 for 5.3%, and the run
ended at 2.1395 against 2.0577 synchronous at H=5, 400 steps; the default now runs it
synchronously, at the H=10 its probe then picks: 2.1012.) With ``H`` "auto" (the default) the
start-up probe has timed a step and a gather already, and the verdict is taken from
those, before step 1: the first outer step overlaps too where the link is slow (at 350 kbit/s
its synchronous gather was 26 s of an 80-step run's 160), unless the gather outlasts about four
periods, where overlap would hide one of them and cost 24% more steps. Overlapping, each gather
lands ``LAND_MARGIN`` (1.5) times its measured length in steps after it was launched (``tau``
0, the default; at most H), by when it has arrived. Every worker takes the same verdict (the
largest ratio measured), and snapshots keep it. Overlap costs loss (above), so a link fast
enough to hide nothing behind is better used synchronously. ``--overlap`` without ``--tau``
lands a period late, as before ``tau`` was built.

Under auto the landing then follows the link (``next_landing``): each worker notes when its
gather was there (the first step boundary at which it had completed, or, where the landing had
to wait, the landing plus the wait in steps) and sends that figure in 4 bytes after its next
message; at that message's landing every worker reads the same figures and moves the landing to
the step the slowest worker's gather was there by (later at once; sooner only with a step to
spare, so that it does not flap between two steps). The first gather is timed alone, and later
ones share the cores with compute and take longer; a link that slows or speeds up mid-run moves
the landing with it. Where the landing moves later than overlap pays for at the share the
verdict was taken on, the next outer step is synchronous, timed after a barrier, and decides
again on the share it measures, landing no sooner than the link asked (``_reweigh``): a link
that slowed goes on overlapped after that one synchronous step, landing later; workers that
drifted apart go synchronous (on loopback a 4 ms gather turned overlap on at landing 1, the
landing then wandered over 2-10 steps with the drift, and the run ended 3% above a synchronous
one). Synchronous under auto, each message carries its sender's wait in the last gather, and a
shortest wait that stays twice its level after the verdict, where overlap would pay by
``watch_margin``, makes the next outer step a timed one that decides again (``_watch``): a link
that slows while the run is synchronous is hidden too.

Memory: the anchor theta, the buffer e, the period's start point (used with overlap) and two
work vectors of the same size (snapshots hold theta and e; the start is rebuilt from the message
in flight), and, for the mean over senders, a count of a byte per entry.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from geotrain.compress.chunked import ChunkTopK, TensorChunks, require_chunking
from geotrain.plan.gather import (
    LATE_LANDING_COST,
    SPARSELOCO_PERIODS,
    choose_sparseloco_period,
    gather_share,
    gather_warning,
    hiding_steps,
    weigh_overlap,
)
from geotrain.plan.profile import probe_step_and_gather, time_gather
from geotrain.sync.base import InFlight, PeriodicSync, SyncConfig, require, require_period
from geotrain.sync.periods import periods_for

# How the gathered messages are averaged: each entry over the workers that sent it (the reference
# code's), or over every worker (an entry a worker did not send counts as its zero).
MEAN_OVER = ("auto", "senders", "workers")
# The bytes after an overlapped message under auto: the sender's arrival figure (float32, steps)
ARRIVAL_BYTES = 4
# A landing's reads and writes at the entries the messages name cost more than passes over the
# whole vector where those entries exceed this fraction of it (``_in_passes``): more than one
# message of 64 in 4096. Measured on GPT ``mini``, one thread (``benchmarks/bench_outer_step.py
# --workers W``, a landing one step into the period): at the entries / in passes 49 / 52 ms with
# 1 worker's message, 78 / 63 with 2, 110 / 69 with 4, 186 / 111 with 8.
DENSE_ABOVE = 1 / 64
# A landing may wait this fraction of a step before the next one lands a step later
WAIT_SLACK = 0.1
# Under auto's synchronous verdict, the shortest wait the gathers carry asks for a timed outer
# step (``_watch``) where it has stood ``WATCH_RISE`` times over its level (the least since the
# verdict) at ``WATCH_PERSIST`` outer steps in a row, and overlap would be sooner to a loss at it
# by ``watch_margin``; the timed step turns overlap on only by that margin too. On 4 workers
# sharing 2 cores the shortest wait is not the link's: on loopback (GPT tiny, 10-step periods of
# 0.08-0.20 s) it measured 0.5-51% of the period from one outer step to the next,
# where gathers timed after a barrier read 0.9-24%; read once, against its level, it asked
# for a timed step one to seven times a run, and three of them turned overlap on (4.9% and 8.0%
# at H=10, 23.6% at H=5), two going off again at the next check.
WATCH_RISE = 2.0
WATCH_PERSIST = 2
WATCH_MARGIN = 0.02


def watch_margin(H: int) -> float:
    """What overlap must win by, in a step, for the watch to turn it on: ``WATCH_MARGIN``, and
    at least what a landing one step later than predicted costs (``LATE_LANDING_COST`` / H),
    so that the landing's check (``SparseLoCo._reweigh``) does not undo it at the first move."""
    return max(WATCH_MARGIN, LATE_LANDING_COST / H)


# --H auto: the period a worker runs at where nothing measured a step and a gather (``prepare``
# not called: geotrain.wrap without ``profile=``), the fixed default's
PROVISIONAL_H = 20


def next_landing(landing: int, arrivals: list[float], H: int) -> int:
    """The landing for the gathers to come, from the workers' arrival figures of the last one
    (steps after its launch at which each worker had it; 0: no figure, a worker that adopted
    another's state). Later at once to the slowest's (a wait under ``WAIT_SLACK`` of a step
    is let go); sooner only where every gather was there two steps before the landing, to one
    step after the slowest: the figures are whole step boundaries there, and a landing set to
    the slowest's boundary exactly would flap between it and the next. Within [1, H]."""
    known = [a for a in arrivals if math.isfinite(a) and a > 0]  # (4 bytes from any peer)
    if not known:
        return landing
    needed = max(1, math.ceil(round(min(max(known), H + 1) - WAIT_SLACK, 6)))
    if needed > landing:
        return min(H, needed)
    if needed < landing - 1:
        return needed + 1
    return landing


class Sent(NamedTuple):
    """What a worker's message decodes to, sparse: in each chunk, the ``idx`` sent and the
    ``values`` at them ((chunks, k) each)."""

    idx: torch.Tensor
    values: torch.Tensor

    def taken_from(self, flat: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``flat`` - ``scale`` x the message, in place, touching only the entries sent (the
        indices of a chunk are distinct: exactly the dense subtraction's result)."""
        rows = flat.view(self.idx.shape[0], -1)
        rows.scatter_add_(1, self.idx, self.values * -scale)
        return flat


@dataclass
class SparseLoCoConfig(SyncConfig):
    # "auto" (the default): chosen at start-up from a step and an outer step's gather as measured
    # (``SparseLoCo.prepare``, ``plan.gather.choose_sparseloco_period``)
    H: int | str = "auto"
    chunk: int = 4096
    k: int = 64
    bits: int = 2
    beta: float = 0.95
    alpha: float = 0.0  # 0: 1 over senders (the paper's), 2 over workers (each the better measured)
    # True, False; auto: decided at start-up (--H auto) or the first outer step, and again where
    # the landing moves later than overlap pays for
    overlap: bool | str = "auto"
    # overlap: steps into the next period at which an outer step's gather lands (1 to H; H: at
    # the next outer step, a period late). 0: auto (measured under --overlap auto, else H).
    tau: int = 0
    mean_over: str = "auto"  # senders, workers; auto: senders unless it lands in a period's second half

    def __post_init__(self) -> None:
        if self.H != "auto":
            require_period(self.H)
        require(
            self.overlap in (True, False, "auto"),
            f"overlap must be True, False or 'auto', got {self.overlap!r}",
        )
        require(
            self.mean_over in MEAN_OVER,
            f"--mean-over must be one of {', '.join(MEAN_OVER)}, got {self.mean_over!r}",
        )
        require_chunking(
            self.chunk, self.k, self.bits, lambda f: f"--{f}", "values per top-k chunk",
            self.chunk, f"--chunk={self.chunk}",
        )  # fmt: skip
        require(0 <= self.beta < 1, f"--beta (error-feedback decay) must be in [0, 1), got {self.beta}")
        # --H auto chooses among the periods the landing fits in
        most = max(SPARSELOCO_PERIODS) if self.H == "auto" else self.H
        require(
            isinstance(self.tau, int) and 0 <= self.tau <= most,
            f"--tau (steps after an outer step at which its gather lands, with overlap) must be an "
            f"integer in [1, H={self.H}{f' (at most {most})' if self.H == 'auto' else ''}], or 0 for "
            f"auto; got {self.tau}",
        )
        require(
            not (self.tau and self.overlap is False),
            f"--tau {self.tau} sets when an overlapped outer step lands, and --no-overlap overlaps none: "
            "drop one of them",
        )
        require(
            self.alpha >= 0, f"--alpha (outer learning rate) must be > 0 (0: --mean-over's), got {self.alpha}"
        )

    def per_sender(self, overlap: bool, tau: int | None = None) -> bool:
        """Whether an entry's mean is over the workers that sent it (``ChunkTopK.mean_of``), with
        or without ``overlap`` (as decided, where it is auto), landing ``tau`` steps into the
        next period (None: a period late). auto: senders unless it lands in the period's second
        half, each the better measured there (module docstring)."""
        if self.mean_over != "auto":
            return self.mean_over == "senders"
        return not overlap or (tau is not None and 2 * tau < self.H)

    def outer_lr(self, overlap: bool, tau: int | None = None) -> float:
        """alpha: as given, or (0) 1 over senders and 2 over workers."""
        return self.alpha or (1.0 if self.per_sender(overlap, tau) else 2.0)

    def codec(self) -> ChunkTopK:
        return ChunkTopK(chunk=self.chunk, k=self.k, bits=self.bits)


class SparseLoCo(PeriodicSync):
    name = "sparseloco"

    def __init__(self, model, optimizer, comm, config: SparseLoCoConfig | None = None) -> None:
        config = config or SparseLoCoConfig()
        # --H auto: the provisional period until ``prepare`` measures and chooses
        self.auto_period = config.H == "auto"
        if self.auto_period:
            config = dataclasses.replace(config, H=max(PROVISIONAL_H, config.tau))
        super().__init__(model, optimizer, comm, config)
        self.period_choice: list[dict] | None = None  # --H auto: the periods weighed
        self.chunker = self.config.codec()
        params = [p.detach() for p in self.parameters()]
        real = sum(p.numel() for p in params)
        require(
            real >= self.config.chunk,
            f"--chunk {self.config.chunk} is larger than the whole model ({real} values): "
            "use a smaller --chunk",
        )
        # Per tensor: each parameter padded to whole chunks; every vector below is in this layout
        # and keeps its padding at zero (``layout.zero_padding``, ``layout.mask``).
        self.layout = TensorChunks([p.numel() for p in params], self.config.chunk)
        self.n = self.layout.numel
        self._anchor = self.layout.flatten(params)  # theta, equal on every worker
        self._error = torch.zeros(self.n)  # e_r
        # Work vectors, reused each outer step: a fresh vector of GPT mini's size costs its page
        # faults (about 0.1 s of CPU here), and an outer step made nine. The parameters in the
        # layout, then the delta, then (once the message is made) the sums of the mean (at the
        # entries the messages hold, or whole), then a landing's change (anchor - start); and the
        # next e, made beside the current one until it is kept.
        self._scratch = torch.zeros(self.n)
        self._spare = torch.zeros(self.n)
        self._start = self._anchor.clone()  # where this period started (overlap)
        # Where the start was moved off the anchor (the entries of the message that stood in for
        # the mean: (chunks, k) indices, none at first); a landing inside the period changes the
        # start there and where the gathered messages hold an entry, nowhere else (``_land_early``).
        self._start_moved_at = self._no_entries()
        # The message the start was moved by, where it is not the one in flight (--chaos spoiled
        # what was sent): a snapshot rebuilds the start from it (None: from the one in flight).
        self._start_message: torch.Tensor | None = None
        self._unspoiled: torch.Tensor | None = None  # the last message made, where it was spoiled
        self._sender_counts: torch.Tensor | None = None  # ``_counts``, made at the first per-sender mean
        self.in_flight = InFlight(comm)  # this worker's message, landing later (``landing``)
        # Overlap on or off; None: auto, not yet decided, or deciding again at this outer step.
        self.overlap: bool | None = None if self.config.overlap == "auto" else bool(self.config.overlap)
        # With overlap: steps into a period at which the last outer step's gather lands (H: at
        # the next outer step); under auto, set with the verdict.
        self.landing = self.config.tau or self.config.H
        self.decision = ""  # what auto measured, for the summary
        self.verdicts_again = 0  # how often auto's verdict was taken again (``_reweigh``, ``_watch``)
        self.last_verdict = ""  # the last of those
        self.clock = time.perf_counter  # tests set their own
        # When the last H steps ended (and when the first began): auto's verdict times the first
        # period with them, and a landing's wait is counted in their steps.
        self._stepped_at: deque[float] = deque([self.clock()], maxlen=self.config.H + 1)
        # Auto's landing follows the link: the steps after its launch at which the gather in
        # flight was seen complete (0: not yet), and this worker's arrival figure for the last
        # landing (sent after its next message)
        self._seen = 0
        self._arrival = 0.0
        self._next_landing = 0  # the landing the last figures asked for, taken at the next outer step
        self.landing_moves = 0
        # Auto's verdict is weighed again where the landing moves (``_reweigh``): the gather's
        # share of the period it was taken on (None: no verdict taken), and, where the landing
        # the link asked for costs more than the wait, that landing (0: none): the next outer
        # step is synchronous and decides again, landing no sooner than it
        self._share: float | None = None
        self._weigh_next = 0
        # Under auto's synchronous verdict: this worker's wait in its last gather, as a share of
        # the period, sent after its next message (``_watch``; 0: none); the shortest such wait
        # after the verdict (None: not yet seen), and whether the next outer step is timed
        self._waited = 0.0
        self._watch_level: float | None = None
        self._rises = 0  # outer steps in a row at which the shortest wait stood risen
        self._check_next = False
        self._check_why = ""

    @property
    def alpha(self) -> float:
        return self.config.outer_lr(bool(self.overlap), self.landing)

    def _per_sender(self) -> bool:
        return self.config.per_sender(bool(self.overlap), self.landing)

    def resolved_options(self) -> dict[str, Any]:
        overlap: bool | str = self.overlap  # as given, or auto's verdict (none before it is taken)
        if self.config.overlap == "auto":
            overlap = f"auto ({'undecided' if self.overlap is None else 'on' if self.overlap else 'off'})"
        mean_over = "senders" if self._per_sender() else "workers"
        options = {"alpha": self.alpha, "overlap": overlap, "mean_over": mean_over}
        if self.auto_period:
            choice = self.period_choice
            how = "not measured" if choice is None else "measured" if choice else "alone"
            options = {"H": f"auto ({how}: {self.config.H})"} | options
        if self.overlap:
            options["tau"] = self.landing
        return options

    # -- --H auto ------------------------------------------------------------------------------
    def prepare(self, loss_fn) -> None:
        """--H auto: time whole steps (``profile_compute``: the parameters and the optimizer's
        state untouched, the batches from the profile's own sampler) and one all-gather of an
        outer step's message, on every worker at once, and take the period with the shortest
        predicted time to a loss (``choose_sparseloco_period``), the slowest worker's compute
        and gather deciding for all. Not again where a restored state holds the choice."""
        if not self.auto_period or self.period_choice is not None:
            return
        periods = tuple(h for h in SPARSELOCO_PERIODS if h >= self.config.tau)  # --tau lands within
        if self.comm.world_size < 2:  # nothing to gather (a joiner, alone until admitted, takes the
            self._set_period(periods[0])  # members' period with their state)
            self.period_choice = []
            return
        compute_s, wait, gather = probe_step_and_gather(
            self.module, self.optimizer, loss_fn, self.comm, self._time_gather
        )
        H, self.period_choice = choose_sparseloco_period(
            compute_s, gather, periods, overlap=self.config.overlap, sync_wait_s=wait, tau=self.config.tau
        )
        self._set_period(H)
        if self.overlap is None:  # --overlap auto: the same figures decide it, before step 1
            period_s = H * compute_s
            self._decide(gather, period_s, gather_share(gather, period_s), at_start=True)
        if self.comm.rank == 0:
            weighed = ", ".join(
                f"H={row['H']} {row['time_to_loss_factor']:.2f}{' overlapped' if row['overlap'] else ''}"
                for row in self.period_choice
            )
            print(
                f"geotrain: sparseloco --H auto: H={H} (a step's compute {compute_s:.3f} s, an outer "
                f"step's gather {gather:.3f} s; time to a loss x nosync's step: {weighed})",
                file=sys.stderr,
                flush=True,
            )

    def prepare_unprofiled(self) -> None:
        if self.auto_period and self.comm.rank == 0:
            print(
                f"geotrain: sparseloco H='auto' needs profile= (a function that computes a training "
                f"loss) to time a step and a gather; running at H={self.config.H}",
                file=sys.stderr,
                flush=True,
            )

    def _time_gather(self) -> float:
        """One all-gather of an outer step's message (zeros, its size)."""
        return time_gather(self.comm, self.chunker.payload_bytes(self.n), self._anchor.device, self.clock)

    def _set_period(self, H: int) -> None:
        """Run at period H from here (``--H auto``'s choice, made or restored before step 1)."""
        self.config = dataclasses.replace(self.config, H=H)
        self.periods = periods_for("", H)
        self.landing = self.config.tau or H
        self._stepped_at = deque(self._stepped_at, maxlen=H + 1)

    # -- the outer step -------------------------------------------------------------------------
    def _local(self) -> torch.Tensor:
        return self.layout.flatten(self.parameters())

    def _delta(self, start: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient ``start`` - this worker's parameters, in the work vector."""
        return self.layout.difference(start, self.parameters(), out=self._scratch)

    def _keep_error(self, error: torch.Tensor) -> None:
        """The message has gone: ``error`` (from ``_message``) becomes e, the old e the spare."""
        if error is self._spare:
            self._spare = self._error
        self._error = error

    def _message(self, delta: torch.Tensor) -> tuple[torch.Tensor, Sent, torch.Tensor]:
        """The payload of the chunked top-k of beta e + delta, what it decodes to (sparse: the
        indices in each chunk and their values), and the e that stays. ``self._error`` is not
        changed yet, so a message that fails to arrive can be made again from the same state
        (``retry_sync``). A worker left out of the average (``contributes``: its delta is a copy
        of the leader's) sends the empty payload, which the decoders leave out, and keeps its e
        as it is. ``delta`` may be the work vector: it is used up here."""
        if not self.contributes():
            empty = torch.zeros(self.chunker.payload_bytes(self.n), dtype=torch.uint8)
            nothing = torch.zeros(self.n // self.config.chunk, 0)
            return empty, Sent(nothing.long(), nothing), self._error.clone()
        error = torch.mul(self._error, self.config.beta, out=self._spare).add_(delta)
        payload, idx, values = self.chunker.encode_sparse(error, work=delta)
        # A chunk with fewer than k real entries sends some of its padding (a zero picked codes to
        # a level of +-scale/3): none of it may stay here, in the start point or in the anchor.
        values.mul_(self.layout.mask.view(-1, self.config.chunk).gather(1, idx))
        spoiled = self.comm.spoiled(error)  # --chaos corrupt: the message only, e stays clean
        self._unspoiled = None
        if spoiled is not None:
            self._unspoiled, payload = payload, self.chunker.encode(spoiled)[0]
        sent = Sent(idx, values)
        return payload, sent, sent.taken_from(error)

    def _land(self, gathered: torch.Tensor) -> tuple[list[float] | None, torch.Tensor | None]:
        """theta <- theta - alpha * mean of the gathered messages (padding kept at zero), over
        the messages the norm check keeps (``--max-norm-ratio``; every worker judges alike): at
        the entries they hold, or in passes over the whole vector (``_in_passes``). Returns the
        check's weights by rank (None: unchecked) and the entries the kept messages hold
        ((chunks, m) indices within each chunk, an entry two sent named twice), or None where
        the mean was made in passes: outside those entries the anchor is as it was."""
        weights = None
        parts = self.chunker.parts_of(gathered, self.n)  # unpacked once, for the check and the mean
        if self.comm.checking:
            weights = self.comm.weigh_gathered(self.chunker.norms(gathered, self.n, parts))
        per_sender = self._per_sender()
        counts = self._counts() if per_sender else None
        # Summed in the work vector: the delta it held has gone into the message (``_message``).
        work = self._scratch.view(-1, self.config.chunk)
        rows = self._anchor.view(-1, self.config.chunk)
        if self._in_passes(parts):
            mean = self.chunker.dense_mean(
                gathered, self.n, weights, per_sender, out=work, counts=counts, parts=parts
            )
            rows.sub_(mean.mul_(self.alpha) if self.alpha != 1.0 else mean)
            touched = None
        else:
            touched, mean = self.chunker.sparse_mean(
                gathered, self.n, weights, per_sender, work=work, counts=counts, parts=parts
            )
            if self.alpha != 1.0:
                mean.mul_(self.alpha)
            rows.scatter_(1, touched, rows.gather(1, touched).sub_(mean))
        self.layout.zero_padding(self._anchor)  # another's message may hold its padding
        return weights, touched

    def _in_passes(self, parts: list) -> bool:
        """Whether the mean lands in passes over the whole vector rather than at the entries the
        messages hold (the same values either way): a value read or written at a random entry
        costs about as much as 1 / ``DENSE_ABOVE`` of them in a pass, and the sparse landing
        makes several such reads and writes at each entry named. Every worker decides alike."""
        named = sum(part is not None for part in parts) * self.config.k
        return named > DENSE_ABOVE * self.config.chunk

    def _counts(self) -> torch.Tensor:
        """The per-sender mean's count per entry, all zero between outer steps (kept: a fresh
        one is a vector of the model's size; a byte per entry while the group is under 256)."""
        dtype = torch.uint8 if self.comm.world_size < 256 else torch.int32
        if self._sender_counts is None or self._sender_counts.dtype != dtype:  # made, or the group grew
            self._sender_counts = torch.zeros(self.n // self.config.chunk, self.config.chunk, dtype=dtype)
        return self._sender_counts

    def _no_entries(self) -> torch.Tensor:
        return torch.zeros(self.n // self.config.chunk, 0, dtype=torch.int64)

    @property
    def follows_link(self) -> bool:
        """The landing moves with the measured arrivals: auto chose it (``--tau`` not given)."""
        return bool(self.overlap) and self.config.overlap == "auto" and not self.config.tau

    @property
    def watches_link(self) -> bool:
        """Synchronous under auto's verdict (``--tau`` not given): each message carries its
        sender's wait in the last gather, and the shortest is weighed (``_watch``)."""
        return (
            self.overlap is False
            and self.config.overlap == "auto"
            and not self.config.tau
            and self._share is not None
        )

    def _with_wait(self, payload: torch.Tensor) -> torch.Tensor:
        figure = torch.tensor([self._waited], dtype=torch.float32).view(torch.uint8)
        return torch.cat([payload, figure])

    def _watch(self, waited: float, figures: list[float], weights: list[float] | None) -> None:
        """Auto's synchronous verdict watched through the waits the last gather carried. The
        worker that reached it last waited least, for the link and for the others to wake to
        it; the least such shortest wait since a verdict is its level. Where one has risen
        ``WATCH_RISE`` times over it and overlap would be sooner to a loss at it by
        ``watch_margin`` at ``WATCH_PERSIST`` outer steps in a row, the next outer step is timed
        after a barrier and decides (``_decide``, by the margin too), as the first one does: a
        link that slowed mid-run is hidden again. Every worker reads the same figures. Each
        worker's own wait here goes with its next message. A figure from a message the check
        left out, or a missing one (a worker that adopted another's state, the first gather
        after a verdict), has no say, and then none is read."""
        period_s = self._step_s() * self.config.H
        self._waited = waited / period_s if period_s > 0 else 0.0
        if weights is not None:
            figures = [f for f, w in zip(figures, weights, strict=False) if w > 0]
        known = [f for f in figures if math.isfinite(f) and f > 0]
        if not known or len(known) < len(figures):
            self._rises = 0  # "in a row": a step with no reading breaks the row
            return
        shortest = min(known)
        if self._watch_level is None:
            self._watch_level = shortest
            return
        verdict = weigh_overlap(shortest, self.config.H)
        rose = shortest >= WATCH_RISE * self._watch_level
        pays = verdict.overlap and verdict.sync - verdict.overlapped >= watch_margin(self.config.H)
        self._rises = self._rises + 1 if rose and pays else 0
        if not rose:  # the level is the least shortest wait since the verdict
            self._watch_level = min(self._watch_level, shortest)
        if self._rises >= WATCH_PERSIST:
            self._check_next = True
            self._check_why = (
                f"the synchronous gathers' shortest wait up from {100 * self._watch_level:.1f}% "
                f"to {100 * shortest:.1f}%"
            )
            if self.comm.rank == 0:
                print(
                    f"geotrain: sparseloco --overlap auto: {self._check_why} of the period; the next "
                    "outer step is timed and decides again",
                    file=sys.stderr,
                    flush=True,
                )

    def _with_arrival(self, payload: torch.Tensor) -> torch.Tensor:
        if not self.follows_link:
            return payload
        figure = torch.tensor([self._arrival], dtype=torch.float32).view(torch.uint8)
        return torch.cat([payload, figure])

    def _message_part(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Gathered messages (or one) without the figures after them (auto's: the arrival of the
        last gather overlapped, or the wait in the last one synchronous), and the figures (none
        where the messages carry none: sent without auto, or saved before it had them)."""
        if rows.shape[-1] != self.chunker.payload_bytes(self.n) + ARRIVAL_BYTES:
            return rows, []
        figures = rows[..., -ARRIVAL_BYTES:].contiguous().view(torch.float32).reshape(-1)
        return rows[..., :-ARRIVAL_BYTES].contiguous(), figures.tolist()

    def _land_in_flight(self, reweigh: bool = True) -> torch.Tensor | None:
        """The gather in flight lands in the anchor; under auto the landing for the next ones
        follows the arrival figures it carried, and this worker's own figure for this one is
        noted (none for a gather sent again after a regroup: its wait is the regroup's). Returns
        the entries the anchor moved at (``_land``: None where it moved in passes over the whole
        vector; none where nothing was in flight)."""
        timed = not self.in_flight.resending
        started = self.clock()
        gathered = self.in_flight.land()
        waited = self.clock() - started
        if gathered is None:
            return self._no_entries()
        gathered, arrivals = self._message_part(gathered)
        weights, touched = self._land(gathered)
        if not self.follows_link:
            return touched
        if weights is not None:  # a message the check left out has no say in the landing either
            arrivals = [a for a, w in zip(arrivals, weights, strict=False) if w > 0]
        step_s = self._step_s()
        late = waited / step_s if step_s > 0 else 0.0
        self._arrival = float(self._seen or self.landing + late) if timed else 0.0
        self._seen = 0
        # Taken at the next outer step: until then every worker must see this period's landing
        # (``collective_period``, a landing redone after a regroup), wherever it is in the period.
        self._next_landing = next_landing(self.landing, arrivals, self.config.H)
        if reweigh:
            self._reweigh()
        return touched

    def _reweigh(self) -> None:
        """Auto's verdict again where the landing moves: where overlap, landing as late as the
        last figures ask, no longer reaches a loss sooner than waiting for the gather (the share
        the verdict was taken on), the next outer step is synchronous and timed after a barrier,
        as the first one is, and decides afresh (``_decide``) on the share it measures, with the
        landing the link asked for as the least it would land at. Every worker reads the same
        figures, so all do it at the same outer step.

        Why both: a gather is seen late where the link slowed, and where a worker drifted ahead
        of the others (on loopback, 4 workers on 2 cores arrive several 20 ms steps apart), and
        the figures cannot tell the two apart. A synchronous gather after a barrier measures the
        link alone. Measured on GPT ``tiny`` (4 workers, loopback, H=10, 400 steps): a first
        gather of 4-5% of the period turned overlap on, landing 1 step late; the landing then
        wandered over 2-10 steps with the drift (moved 29 times in one run), and those runs
        ended 3.0-3.5% above the synchronous ones, where landing at 1 throughout (``--tau 1``)
        cost 0.7% on the mean of 8 seeds. There a share of 4% against a landing of 2 of 10
        already goes synchronous (1.08 against 1.04); a 3.5 Mbit/s link slowed to 1.2 Mbit/s
        took one synchronous outer step (a share of 9.4%, the figures asking for 6 of 20), timed
        23.2%, and went on overlapped, landing 7 of 20 (docs/frontier.md). Not at a landing taken
        at the outer step itself (after a regroup, or at H), nor in ``finalize``: there the
        figures are weighed at the next landing."""
        moved = self._next_landing
        if self._share is None or not moved or moved <= self.landing or self._weigh_next:
            return
        verdict = weigh_overlap(self._share, self.config.H, tau=moved)
        if verdict.overlap:
            return
        self._weigh_next = moved
        if self.comm.rank == 0:
            print(
                f"geotrain: sparseloco --overlap auto: the gathers were there {moved} of "
                f"{self.config.H} steps after their launch; landing that late costs "
                f"{100 * verdict.penalty:.0f}% more steps (overlapped {verdict.overlapped:.3f} against "
                f"synchronous {verdict.sync:.3f} at the share measured before); the next outer step "
                "is synchronous and decides again",
                file=sys.stderr,
                flush=True,
            )

    def _to_undecided(self) -> None:
        """This outer step synchronous and timed (``_reweigh``): the gather in flight, where one
        is, lands first with the mean and alpha it was launched with, the replica moving with
        the anchor as at a landing inside the period (``_land_early``), so that the synchronous
        pseudo-gradient is the whole period's progress."""
        if self.in_flight.flying:
            self._land_early()
        self.overlap = None
        self._next_landing, self._seen, self._arrival = 0, 0, 0.0

    def _take_next_landing(self) -> None:
        moved, self._next_landing = self._next_landing, 0
        if not moved or moved == self.landing:
            return
        if self.comm.rank == 0:
            print(
                f"geotrain: sparseloco: the last gathers arrived later or sooner than they landed; "
                f"landing moved from {self.landing} to {moved} of {self.config.H} steps",
                file=sys.stderr,
                flush=True,
            )
        self.landing = moved
        self.landing_moves += 1

    def _set_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            self.layout.copy_into(flat, [p.data for p in self.parameters()])

    def after_step(self) -> bool:
        self._stepped_at.append(self.clock())
        if self.follows_link and not self._seen and self.in_flight.arrived():
            self._seen = (self.step_count + 1) % self.config.H or self.config.H  # this step's end
        synced = super().after_step()
        if not synced and self._lands_now():
            self._land_early()
        return synced

    def _lands_now(self) -> bool:
        # outer steps are at every H-th step (sparseloco has no warm start or H schedule), so
        # the steps since the last one are the step count's remainder; H itself lands there
        return (
            bool(self.overlap) and self.step_count % self.config.H == self.landing and self.in_flight.flying
        )

    def collective_period(self) -> int:
        # Landing inside a period waits for the gather, or sends it again after a regroup: a
        # survivor past it and one before it must not go on each from its own step (one would
        # gather alone), so the regroup treats the landing as a collective too.
        period = super().collective_period()
        if self.overlap and self.landing < self.config.H:
            return math.gcd(period, self.landing)
        return period

    def retry_sync(self, adopters: Collection[int] = ()) -> None:
        super().retry_sync(adopters)
        if self._lands_now():  # this step's landing failed with the group: land on the new one
            self._land_early()

    def _land_early(self) -> None:
        """``tau`` steps into the period: the last outer step's mean lands in the anchor, and
        this worker's stand-in for it (its own message, in the period's start) is replaced by
        it, in the start and in the parameters alike: x <- x + (new anchor - start). From here
        the period goes on as if it had started from the new anchor; the next pseudo-gradient
        is still the whole period's progress (start - x).

        The start differs from the anchor only where the message that stood in for the mean
        took it off (``_start_moved_at``: this worker's own, clean even where ``--chaos``
        spoiled what was sent, or, for one that adopted another's state, that worker's), and
        the mean moves the anchor only where a message it kept holds an entry: where those are
        few (``_in_passes``), the change is made at those entries alone, not by three passes
        over the model. (In passes, a parameter that is -0.0 where nothing changed becomes
        +0.0: the same value.)"""
        touched = self._land_in_flight()
        moved_at, self._start_moved_at, self._start_message = self._start_moved_at, self._no_entries(), None
        if touched is None:  # landed in passes: x <- x + (new anchor - start) in passes too
            change = torch.sub(self._anchor, self._start, out=self._scratch)
            self._start.copy_(self._anchor)
            with torch.no_grad():
                self.layout.add_into(change, [p.data for p in self.parameters()])
            return
        touched = torch.cat([touched, moved_at], dim=1)  # an entry in both is read alike
        anchor = self._anchor.view(-1, self.config.chunk).gather(1, touched)
        start = self._start.view(-1, self.config.chunk)
        change = anchor - start.gather(1, touched)
        start.scatter_(1, touched, anchor)
        with torch.no_grad():
            self.layout.add_into_at(touched, change, [p.data for p in self.parameters()])

    def outer_step(self) -> None:
        if self._weigh_next and self.follows_link:  # (only auto's own landing asks for it)
            self._to_undecided()
        if self._check_next and self.watches_link:  # (synchronous: nothing in flight)
            self.overlap = None
        if not self.overlap:  # off, or auto deciding (first or again): synchronous (and timed)
            deciding, watching = self.overlap is None, self.watches_link
            payload, _, error = self._message(self._delta(self._anchor))
            if deciding:  # every worker here first: the time is the link's, not a slower worker's
                self.comm.barrier()
            started = self.clock()
            gathered = self.comm.all_gather(self._with_wait(payload) if watching else payload)
            waited = self.clock() - started
            # (a failure up to here has changed nothing that a retry does not redo alike:
            # ``_to_undecided`` has landed what was in flight and left ``_weigh_next`` set)
            verdict = self._verdict(waited) if deciding else None
            gathered, figures = self._message_part(gathered)
            weights, _ = self._land(gathered)
            self._keep_error(error)
            self._set_params(self._anchor)
            if verdict is not None:
                self._decide(*verdict)
            elif watching:
                self._watch(waited, figures, weights)
        else:
            payload, sent, error = self._message(self._delta(self._start))
            self._land_in_flight(reweigh=False)  # the last period's; if it fails, nothing here has changed
            self._take_next_landing()  # before alpha is read: it follows the landing
            self._keep_error(error)
            self.in_flight.launch(self._with_arrival(payload))
            # Eager: this worker's own message stands in for the mean until the mean lands.
            sent.taken_from(self._start.copy_(self._anchor), self.alpha)
            self._start_moved_at, self._start_message = sent.idx, self._unspoiled
            self._set_params(self._start)
        self.syncs += 1

    def _step_s(self) -> float:
        """The median interval between the last H steps' ends (0 before one has ended)."""
        times = self._stepped_at
        return statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else 0.0

    def _restart_timing(self) -> None:
        self._stepped_at.clear()
        self._stepped_at.append(self.clock())

    def _verdict(self, gather_s: float) -> tuple[float, float, float]:
        """--overlap auto: this worker's gather time and the period's compute (H times the median
        interval between the steps before it, so a validation or the first step's start-up
        does not count), and the largest ratio of the two over the workers."""
        period_s = self._step_s() * self.config.H
        # A worker that timed no step here (it adopted another's state for this sync) has no
        # say: -1 leaves the others' verdict, and where no worker has one, none is taken yet.
        ratio = gather_share(gather_s, period_s) if period_s > 0 else -1.0
        (most,) = self.comm.max_scalars([ratio])
        return gather_s, period_s, most

    def _decide(
        self,
        gather_s: float,
        period_s: float,
        ratio: float,
        at_start: bool = False,
    ) -> None:
        """Take auto's verdict (``plan.gather.weigh_overlap``): overlap where that reaches a loss
        sooner, the gather taking ``ratio`` of the period's compute (the largest over the
        workers) and landing ``LAND_MARGIN`` times its steps later, each step late costing steps
        to a loss; synchronous, the gather shows. Made at the first outer step, or before step 1 where ``--H
        auto`` measured a gather and a step already (``prepare``), so that the first outer step
        of a slow link is not waited for; and again at an outer step ``_reweigh`` asked for,
        landing no sooner than the figures asked (``_weigh_next``, kept where no worker timed a
        step, for the outer step that decides instead), or where the waits of synchronous
        gathers rose (``_check_next``: ``_watch``)."""
        self._start = self._anchor.clone()
        self._start_moved_at = self._no_entries()
        if ratio < 0:  # no worker timed a step: the next outer step is timed instead
            self._restart_timing()
            return
        H = self.config.H
        again, self._weigh_next = self._weigh_next, 0
        tau = max(again, hiding_steps(1.0, ratio * H, H)) if again else self.config.tau
        verdict = weigh_overlap(ratio, H, tau=tau)
        watched, self._check_next, self._rises = self._check_next, False, 0
        if watched and verdict.overlap and verdict.sync - verdict.overlapped < watch_margin(H):
            verdict = dataclasses.replace(verdict, overlap=False)  # a near tie stays as it was
        self.overlap, self._share, self._waited, self._watch_level = verdict.overlap, ratio, 0.0, None
        if self.overlap:  # lands once it has arrived, with a margin (or at --tau)
            self.landing = verdict.landing
        lands = f", each gather landing {self.landing} of {H} steps later" if self.overlap else ""
        timed = "at start-up, a gather" if at_start else "the first outer step's gather"
        if again:
            timed = (
                f"again at step {self.step_count}, the gathers there {again} of {H} steps after "
                "launch; a gather"
            )
        elif watched:
            timed = f"again at step {self.step_count}, {self._check_why}; a gather"
        whose = "the slowest worker's share" if at_start else "the largest share on any worker"
        taken = (
            f"--overlap auto: {'on' if self.overlap else 'off'} ({timed} took "
            f"{gather_s:.3f} s against {period_s:.2f} s of the period's compute; {whose} "
            f"{100 * ratio:.1f}%; time to a loss x nosync's: synchronous {verdict.sync:.3f}, "
            f"overlapped {verdict.overlapped:.3f} (landing {verdict.landing} of {H} steps late: "
            f"{100 * verdict.penalty:.0f}% more steps){lands})"
        )
        # The summary keeps the first verdict, and the last of those taken again with their count
        if (again or watched) and self.decision:
            self.verdicts_again += 1
            self.last_verdict = taken
        else:
            self.decision = taken
        if self.comm.rank == 0:
            print(f"geotrain: sparseloco {taken}", file=sys.stderr, flush=True)

    synchronize = outer_step

    def finalize(self) -> None:
        if self.overlap:
            self._land_in_flight(reweigh=False)
            if self.at_boundary():
                # No step since the last message: a message now would be an extra outer step
                # made of error-feedback residual alone.
                self._set_params(self._anchor)
                return
            payload, _, error = self._message(self._delta(self._start))
        elif not self.at_boundary():
            payload, _, error = self._message(self._delta(self._anchor))
        else:
            return
        self._land(self.comm.all_gather(payload))
        self._keep_error(error)
        self._set_params(self._anchor)

    def close(self) -> None:
        self.in_flight.close()

    def rebind(self) -> None:
        self.in_flight.rebind()  # a lost worker's part of the message in flight is lost with it

    def adopted_state(self) -> None:
        # This worker loaded another's state (a joiner, a survivor behind): that worker's
        # unsent residual and message in flight are its own, and would count twice here.
        self._error.zero_()
        self.in_flight.adopted()
        self._arrival, self._seen, self._waited = 0.0, 0, 0.0  # the other worker's timing, not this one's

    @property
    def measures_noise(self) -> bool:  # type: ignore[override]
        # --lr-scale auto needs a period's first step taken from common parameters: under
        # overlap (auto may turn it on) each worker starts from the anchor moved by its own message
        return self.config.overlap is False

    def replicated_parts(self) -> set[str]:
        # e is each worker's own, so "sync" never is; under overlap neither are the parameters.
        return {"model"} if self.at_boundary() and not self.overlap else set()

    def _in_layout(self, flat: torch.Tensor) -> torch.Tensor:
        """A vector saved before chunks were per tensor (the parameters end to end) moved into
        this layout; a message in flight of that layout cannot be, and is not resent."""
        return self.layout.padded_from_real(flat) if flat.numel() == self.layout.real != self.n else flat

    def info(self) -> str:
        payload = self.chunker.payload_bytes(self.n)
        real = self.layout.real
        warning = gather_warning(payload, real, self.comm.world_size)
        return "; ".join(
            filter(
                None,
                [
                    f"{self.chunker.info()} per tensor: {payload} bytes per worker per outer step "
                    f"({4 * real / payload:.0f}x less than fp32)",
                    warning,
                    self.decision,
                    self.verdicts_again
                    and f"taken again {self.verdicts_again} time{'s' if self.verdicts_again > 1 else ''} "
                    f"(the landing moved, or the synchronous waits rose), the last: {self.last_verdict}",
                    self.landing_moves
                    and f"the landing followed the gathers' arrivals: moved {self.landing_moves} times"
                    + (f", now {self.landing} of {self.config.H} steps" if self.overlap else ""),
                ],
            )
        )

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["anchor"] = self._anchor
        state["error"] = self._error
        # A message in flight is saved as this worker's own payload; a resumed run gathers it
        # again at its next sync, so N + stop + N lands the same bytes as 2N. It also gives the
        # period's start under overlap (anchor - alpha * that message), which is not saved.
        state["in_flight"] = self.in_flight.saved()
        if self._start_message is not None and self.in_flight.flying:
            state["start_message"] = self._start_message
        state["overlap"] = self.overlap  # None: auto, not yet decided
        state["landing"] = self.landing
        state["arrival"] = self._arrival
        state["next_landing"] = self._next_landing
        state["landing_moves"] = self.landing_moves
        state["overlap_decision"] = self.decision
        state["overlap_share"] = self._share
        state["overlap_weigh_next"] = self._weigh_next
        state["overlap_verdicts_again"] = [self.verdicts_again, self.last_verdict]
        state["overlap_waited"] = self._waited
        state["overlap_watch"] = [self._watch_level, self._check_next, self._check_why, self._rises]
        if self.auto_period:
            state["period"] = {"H": self.config.H, "choice": self.period_choice}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.auto_period and state.get("period"):  # the period chosen at the run's start, first:
            self._set_period(int(state["period"]["H"]))  # the base reads its boundaries with it
            self.period_choice = state["period"]["choice"]
        super().load_state_dict(state)
        self._anchor.copy_(self._in_layout(state["anchor"]))
        self._error.copy_(self._in_layout(state["error"]))
        # A message saved in the flat layout before chunks were per tensor cannot be resent.
        resend = state["in_flight"] if state["anchor"].numel() == self.n else None
        self.in_flight.restore(resend)
        if self.config.overlap == "auto":
            # A state saved before --overlap auto ran with overlap on, the default then.
            self.overlap = state.get("overlap", True)
            self.decision = state.get("overlap_decision", "")
            self._restart_timing()
            # one saved before the gather could land inside a period landed a period late
            self.landing = self.config.tau or state.get("landing", self.config.H)
        self._arrival, self._seen = state.get("arrival", 0.0), 0
        self._next_landing = state.get("next_landing", 0)
        self.landing_moves = state.get("landing_moves", 0)
        if self.config.overlap == "auto" and not self.config.tau:  # auto's own landing only
            # (a state saved before the verdict was weighed again has no share: kept for the run)
            self._share, self._weigh_next = state.get("overlap_share"), state.get("overlap_weigh_next", 0)
            self.verdicts_again, self.last_verdict = state.get("overlap_verdicts_again", [0, ""])
            self._waited = state.get("overlap_waited", 0.0)
            watch = state.get("overlap_watch", [None, False, "", 0])
            self._watch_level, self._check_next, self._check_why, self._rises = watch
        self._start_moved_at, self._start_message = self._no_entries(), None
        if self.overlap and resend is not None:
            # the message the start was moved by: the one in flight, unless it was spoiled
            saved = self._message_part(state.get("start_message", resend))[0]
            sent = self.chunker.decode(saved, self.n)
            self.layout.zero_padding(sent)
            self._start = self._anchor - self.alpha * sent
            if saved.any():  # an adopter's empty stand-in moved nothing
                self._start_moved_at = self.chunker.parts_of(saved.unsqueeze(0), self.n)[0][2]
        else:
            self._start = self._anchor.clone()
