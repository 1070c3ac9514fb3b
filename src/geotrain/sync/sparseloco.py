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
figures decide for all; the choice is saved with the run. Under ``--overlap auto`` a verdict
taken again mid-run (a link that slowed) weighs the longer periods too, and moves to one that
reaches a loss 5% sooner (``AutoOverlap._better_period``; snapshots hold the moves).

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

``overlap`` "auto" (the default) overlaps only where that reaches a loss sooner, from a gather
timed against the period's compute, and follows the link from there: the landing moves with the
gathers' arrivals, and the verdict is taken again where the landing moves too late or a
synchronous run's waits rise (``geotrain.sync.auto_overlap``, which says how and what it was
measured on).

Memory: the anchor theta, the buffer e, the period's start point (used with overlap) and two
work vectors of the same size (snapshots hold theta and e; the start is rebuilt from the message
in flight), and, for the mean over senders, a count of a byte per entry.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from geotrain.compress.chunked import ChunkTopK, TensorChunks, require_chunking
from geotrain.plan.gather import (
    SPARSELOCO_PERIODS,
    choose_sparseloco_period,
    gather_share,
    gather_warning,
)
from geotrain.plan.profile import probe_step_and_gather, time_gather
from geotrain.sync.auto_overlap import AutoOverlap, next_landing
from geotrain.sync.base import InFlight, PeriodicSync, SyncConfig, own_value, require, require_period
from geotrain.sync.periods import periods_for

# How the gathered messages are averaged: each entry over the workers that sent it (the reference
# code's), or over every worker (an entry a worker did not send counts as its zero).
MEAN_OVER = ("auto", "senders", "workers")
# A landing's reads and writes at the entries the messages name cost more than passes over the
# whole vector where those entries exceed this fraction of it (``_in_passes``): more than one
# message of 64 in 4096. Measured on GPT ``mini``, one thread (``benchmarks/bench_outer_step.py
# --workers W``, a landing one step into the period): at the entries / in passes 49 / 52 ms with
# 1 worker's message, 78 / 63 with 2, 110 / 69 with 4, 186 / 111 with 8.
DENSE_ABOVE = 1 / 64
# --H auto: the period a worker runs at where nothing measured a step and a gather (``prepare``
# not called: geotrain.wrap without ``profile=``), the fixed default's
PROVISIONAL_H = 20


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


class SparseLoCo(AutoOverlap, PeriodicSync):
    name = "sparseloco"

    def __init__(self, model, optimizer, comm, config: SparseLoCoConfig | None = None) -> None:
        config = config or SparseLoCoConfig()
        # --H auto: the provisional period until ``prepare`` measures and chooses
        self.auto_period = config.H == "auto"
        if self.auto_period:
            config = dataclasses.replace(config, H=max(PROVISIONAL_H, config.tau))
        super().__init__(model, optimizer, comm, config)
        self.period_choice: list[dict] | None = None  # --H auto: the periods weighed
        # --H auto: [step, H] where a verdict taken again moved the period; the longer period
        # chosen for a later outer step, a multiple of it, with the figures to decide there
        # ([H, gather s, its period's compute s, share, least landing, step chosen at]; None: none)
        self.period_moves: list[list[int]] = []
        self._period_next: list | None = None
        # --H auto: a step's compute as the start-up probe timed it (0: not measured), and the
        # last timed gather's share of a period of such steps (``AutoOverlap._verdict``)
        self.probe_step_s = 0.0
        self._nominal_share: float | None = None
        # --H auto: the arrival figure that last asked for a timed step past the period
        # (``AutoOverlap._weigh_longer``; 0: none since the period last moved)
        self._longer_asked = 0.0
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
        # this worker's message, landing later (``landing``); the landed gather kept (a few KB
        # of payloads) for a survivor whose wait failed where this one's completed
        self.in_flight = InFlight(comm, keeps_landed=True)
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
        # share of the period it was taken on (None: no verdict taken)
        self._share: float | None = None
        # Under auto's synchronous verdict: this worker's wait in its last gather, as a share of
        # the period, sent after its next message (``_watch``; 0: none); the shortest such wait
        # after the verdict (None: not yet seen)
        self._waited = 0.0
        self._watch_level: float | None = None
        self._rises = 0  # outer steps in a row at which the shortest wait stood risen
        # Auto's verdict to be taken again at the next outer step (``_decide_again``): why, and
        # the least landing (0: none); None: not asked
        self._again: tuple[str, int] | None = None

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
            how += ", then moved with the link" if self.period_moves else ""
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
        self.probe_step_s = compute_s  # the slowest worker's: the same on every worker
        H, self.period_choice = choose_sparseloco_period(
            compute_s, gather, periods, overlap=self.config.overlap, sync_wait_s=wait, tau=self.config.tau
        )
        self._set_period(H)
        if self.overlap is None:  # --overlap auto: the same figures decide it, before step 1
            period_s = H * compute_s
            self._decide(gather, period_s, gather_share(gather, period_s), at_start=True)
        weighed = ", ".join(
            f"H={row['H']} {row['time_to_loss_factor']:.2f}{' overlapped' if row['overlap'] else ''}"
            for row in self.period_choice
        )
        self.notice(
            f"sparseloco --H auto: H={H} (a step's compute {compute_s:.3f} s, an outer "
            f"step's gather {gather:.3f} s; time to a loss x nosync's step: {weighed})"
        )

    def prepare_unprofiled(self) -> None:
        if self.auto_period:
            self.notice(
                f"sparseloco H='auto' needs profile= (a function that computes a training "
                f"loss) to time a step and a gather; running at H={self.config.H}",
            )

    def _time_gather(self) -> float:
        """One all-gather of an outer step's message (zeros, its size)."""
        return time_gather(self.comm, self.chunker.payload_bytes(self.n), self._anchor.device, self.clock)

    def _set_period(self, H: int) -> None:
        """Run at period H from here (``--H auto``'s choice, made or restored before step 1, or
        moved at an outer step that is a multiple of H: ``AutoOverlap._switch_period``)."""
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
            self._unspoiled = None  # (its start moved by nothing: a spoiled message is no longer its own)
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

    def _land_in_flight(self, reweigh: bool = True, longer: bool = True) -> torch.Tensor | None:
        """The gather in flight lands in the anchor; under auto the landing for the next ones
        follows the arrival figures it carried, and this worker's own figure for this one is
        noted (none for a gather sent again after a regroup: its wait is the regroup's). The
        figures are weighed (``reweigh``: the landing's check, ``_reweigh``; ``longer``: under
        --H auto, figures past the period, ``_weigh_longer``) where those are asked for. Returns
        the entries the anchor moved at (``_land``: None where it moved in passes over the whole
        vector; none where nothing was in flight)."""
        flight = self.in_flight
        timed = not (flight.resending or flight.primed or flight.untimed)  # (no wait of its own)
        started = self.clock()
        gathered = self.in_flight.land()
        waited = self.clock() - started
        if gathered is None:
            return self._no_entries()
        gathered, arrivals = self._message_part(gathered)
        with flight.rows_judged():  # (rows kept from the group before: judged as that group's)
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
        # (a landing redone after a regroup, or a joiner's: the regroup places each survivor by
        # its message in flight, ``places_by_message``), wherever it is in the period.
        self._next_landing = next_landing(self.landing, arrivals, self.config.H)
        if reweigh:
            self._reweigh()
        if longer:
            self._weigh_longer(max((a for a in arrivals if math.isfinite(a) and a > 0), default=0.0))
        return touched

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

    def retry_sync(self, adopters: Collection[int] = ()) -> None:
        super().retry_sync(adopters)
        if self._lands_now():  # this step's landing failed with the group: land on the new one
            self._land_early()

    def _land_early(self, reweigh: bool = True, longer: bool = True) -> None:
        """``tau`` steps into the period: the last outer step's mean lands in the anchor, and
        this worker's stand-in for it (its own message, in the period's start) is replaced by
        it, in the start and in the parameters alike: x <- x + (new anchor - start). From here
        the period goes on as if it had started from the new anchor; the next pseudo-gradient
        is still the whole period's progress (start - x).

        The start differs from the anchor only where the message that stood in for the mean
        took it off (``_start_moved_at``: this worker's own, clean even where ``--chaos``
        spoiled what was sent; none for one that adopted another's state, which starts from the
        anchor), and
        the mean moves the anchor only where a message it kept holds an entry: where those are
        few (``_in_passes``), the change is made at those entries alone, not by three passes
        over the model. (In passes, a parameter that is -0.0 where nothing changed becomes
        +0.0: the same value.)"""
        touched = self._land_in_flight(reweigh, longer)
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
        if self._period_next and self.step_count % self._period_next[0] == 0:
            self._take_next_period()  # --H auto: a longer period chosen at a verdict taken again
        if self._again:  # (asked under auto's own landing alone, and restored under it alone)
            self._to_undecided()
        if not self.overlap:  # off, or auto deciding (first or again): synchronous (and timed)
            deciding, watching = self.overlap is None, self.watches_link
            payload, _, error = self._message(self._delta(self._anchor))
            if deciding:  # every worker here first: the time is the link's, not a slower worker's
                self.comm.barrier()
            started = self.clock()
            gathered = self.comm.all_gather(self._with_figure(payload, self._waited) if watching else payload)
            waited = self.clock() - started
            # (a failure up to here has changed nothing that a retry does not redo alike:
            # ``_to_undecided`` has landed what was in flight and left ``_again`` set)
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
            self.in_flight.launch(self._with_figure(payload, self._arrival) if self.follows_link else payload)
            # Eager: this worker's own message stands in for the mean until the mean lands.
            sent.taken_from(self._start.copy_(self._anchor), self.alpha)
            self._start_moved_at, self._start_message = sent.idx, self._unspoiled
            self._set_params(self._start)
        self.syncs += 1

    synchronize = outer_step

    def finalize(self) -> None:
        if self.overlap:
            self._land_in_flight(reweigh=False, longer=False)
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

    # An adopter starts from the anchor (below): a hand-over carries no parameters, which under
    # overlap are each worker's own anyway (its period began from its own message).
    parameters_from_state = True
    places_by_message = True  # each message launched at an outer step, landing tau steps on

    def adopted_state(self) -> None:
        # This worker loaded another's state (a joiner, a survivor behind): that worker's
        # unsent residual and message in flight are its own, and would count twice here. Its
        # parameters and its period's start become the anchor: its stand-in for the mean in
        # flight is its own message, which is empty.
        self._error.zero_()
        self.in_flight.adopted()
        self._arrival, self._seen, self._waited = 0.0, 0, 0.0  # the other worker's timing, not this one's
        self._start = self._anchor.clone()
        self._start_moved_at, self._start_message = self._no_entries(), None
        self._set_params(self._anchor)

    @property
    def measures_noise(self) -> bool:  # type: ignore[override]
        # --lr-scale auto needs a period's first step taken from common parameters: under
        # overlap (auto may turn it on) each worker starts from the anchor moved by its own message
        return self.config.overlap is False

    def shared_state(self) -> list[torch.Tensor]:
        return [self._anchor]  # under overlap each replica starts a period from its own message

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
                    "(the landing moved, the synchronous waits rose, or the period moved), "
                    f"the last: {self.last_verdict}",
                    self.period_moves
                    and "the period moved with the link: "
                    + ", ".join(f"H={H} from step {step}" for step, H in self.period_moves),
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
        # this worker's alone ("own"): in its snapshots, never handed to an adopter (who would
        # zero it: ``adopted_state``), so a joiner's hand-over is a third smaller
        state["own"] = {**state.get("own", {}), "error": self._error}
        # A message in flight is saved as this worker's own payload; a resumed run gathers it
        # again at its next sync, so N + stop + N lands the same bytes as 2N. It also gives the
        # period's start under overlap (anchor - alpha * that message), which is not saved.
        state["in_flight"] = self.in_flight.saved()
        state["in_flight_result"] = self.in_flight.primed_result  # (kept at a regroup: lands it too)
        state["in_flight_hosts"] = self.in_flight.primed_hosts  # (its rows' hosts, for the check)
        if self._start_message is not None and self.in_flight.flying:
            state["start_message"] = self._start_message
        state["overlap"] = self.overlap  # None: auto, not yet decided
        state["landing"] = self.landing
        state["arrival"] = self._arrival
        state["next_landing"] = self._next_landing
        state["landing_moves"] = self.landing_moves
        state["overlap_decision"] = self.decision
        state["overlap_share"] = self._share
        state["overlap_again"] = self._again
        state["overlap_verdicts_again"] = [self.verdicts_again, self.last_verdict]
        state["overlap_waited"] = self._waited
        state["overlap_watch"] = [self._watch_level, self._rises]
        if self.auto_period:
            state["period"] = {"H": self.config.H, "choice": self.period_choice}
            state["period"] |= {"moves": self.period_moves, "next": self._period_next}
            state["period"]["step_s"] = self.probe_step_s
            state["period"]["longer_asked"] = self._longer_asked
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.auto_period and state.get("period"):  # the period chosen at the run's start, first:
            self._set_period(int(state["period"]["H"]))  # the base reads its boundaries with it
            self.period_choice = state["period"]["choice"]
            self.period_moves = [list(move) for move in state["period"].get("moves", [])]
            self.probe_step_s = state["period"].get("step_s", 0.0)
            self._longer_asked = state["period"].get("longer_asked", 0.0)
        super().load_state_dict(state)
        self._anchor.copy_(self._in_layout(state["anchor"]))
        error = own_value(state, "error")
        self._error.copy_(self._in_layout(error)) if error is not None else self._error.zero_()
        # A message saved in the flat layout before chunks were per tensor cannot be resent.
        resend = state["in_flight"] if state["anchor"].numel() == self.n else None
        self.in_flight.restore(
            resend, self.device, state.get("in_flight_result"), state.get("in_flight_hosts")
        )
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
            self._share, self._again = state.get("overlap_share"), state.get("overlap_again")
            if "overlap_share" not in state and self.overlap is not None:
                # Saved before the verdict was weighed again: the share it was taken on is not
                # known, and neither check can weigh without it, so the next outer step is timed
                # and decides again (one synchronous gather), and the checks follow from there.
                self._again = ("resumed from a state saved without the share of its verdict", 0)
            if self.auto_period:  # a longer period chosen, for a later outer step
                self._period_next = (state.get("period") or {}).get("next")
            self.verdicts_again, self.last_verdict = state.get("overlap_verdicts_again", [0, ""])
            self._waited = state.get("overlap_waited", 0.0)
            self._watch_level, self._rises = state.get("overlap_watch", [None, 0])
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
