"""``co2``: CO2 (Sun, Qin, Sun, Li, Li, Shen, Qiao, Zhong, arXiv 2401.16265).

Local-updating with the outer synchronisation overlapped: the all-reduce of one period's
pseudo-gradient runs under the next period's inner steps, and the outer step it feeds is taken
late: ``tau`` steps into the next period (``--tau``; tau = H is the paper's, one period late).
With A_k the anchor (bitwise equal on every worker), S_r,k where worker r started period k, x_r
its parameters after the period's H inner steps, and m the outer momentum, at each outer step:

    Delta_r,k = S_r,k - x_r                        (launched: a mean all-reduce, asynchronous)
    x_r      <- S_r,k+1 = A - w (alpha / lambda) Delta_r,k   (eager: its own pseudo-gradient
                                        stands in for the mean in flight; without, A)

and tau steps later, when mean_r Delta_r,k has arrived under compute (at the next outer step,
before its own launch, where tau = H):

    m        <- beta * m + mean_r Delta_r,k / lambda      (the staleness gap penalty lambda)
    m        <- clamp(m, -phi, phi)                        (outer momentum clipping)
    A        <- A - alpha * m
    x_r      <- x_r + (A - S_r,k+1);  S_r,k+1 <- A      (the mean replaces the stand-in)

so a worker never waits for the network unless one exchange takes longer than tau steps of
compute. The price is staleness: a period's progress enters the anchor tau steps late, and
until then each replica holds its own stand-in for it.

Defaults and where they come from. The paper's symbols are tau (the period: our ``H``; our
``tau``, as Streaming DiLoCo's and SparseLoCo's, is where the exchange lands), the outer learning
rate alpha (``outer_lr``), the outer momentum beta (``outer_momentum``), the penalty lambda
(``gap_penalty``) and the clip threshold phi (``clip``). The public implementation
(weigao266/fairscale-CO2) takes alpha 1.0, beta 0.2 in its GPT-2 example, a constant penalty
dividing the pseudo-gradient, and phi 1.0. The paper computes its penalty from the parameters at
each outer step; we could not obtain that formula here, so lambda is the public code's constant
(a constant lambda is the same as alpha / lambda: it only rescales the step). That code's clip
is ``torch.clamp`` without ``out=``, so it never clips; ours clamps the momentum element-wise, in
place (``clip=0`` turns it off).

Why the stale step needs care: if H local steps took a replica most of the way to its local
optimum, Delta_k ~ A_k - x*, and A_k+1 = A_k - alpha Delta_k-1 gives e_k+1 = e_k - alpha e_k-1,
whose roots have |r| = sqrt(alpha): at alpha = 1 it oscillates and never settles. Measured on GPT
``tiny`` a period late (4 workers, batch 16, H 20, 400 steps, final validation loss; DiLoCo 2.00,
Streaming DiLoCo 2.01, no communication 2.16): the public code's alpha 1, beta 0.2 gives 3.06;
lambda 2 (alpha / 2) gives 2.28; lambda 3 2.38. With ``eager`` (Kale et al. 2025, "Eager updates
for overlapped communication and computation in DiLoCo"; as ``sparseloco`` lands its step),
each period starts from A - (alpha / lambda) Delta_own, this worker's own pseudo-gradient
standing in for the mean still in flight: alpha 1, beta 0.2 gives 2.15; alpha 0.7, beta 0.5 2.10
(the best of nine settings: alpha 0.5-1.5, beta 0-0.7, lambda 1-2). So the defaults are eager,
alpha 0.7, beta 0.5, lambda 1 and phi 1.0; H 10 with 4-bit messages (``bits``, below; the paper
runs 12 and 48).

Where the mean lands (``tau``, a later session). A period late, CO2 trails plain Local SGD on
``tiny`` (seed 0, the same command with ``--algo``: DiLoCo 2.0233, Local SGD 2.0842, CO2 2.1197;
seed 1: 2.1989, -, 2.2954), and on W1 (GPT ``mini``, 2,000 steps) it needed ~1.46x DDP's tokens.
Landing sooner, the stand-in lasts tau steps instead of H: on ``tiny`` at H 20, tau 1 2.0737
(seed 1: 2.2503), tau 3 2.0762, tau 10 2.0923; at H 10, tau 3 2.0627. ``tau="auto"``, the
default, lands at the fewest steps that hide 1.5 times one exchange of the run's size (timed on
at most a MiB, scaled by the bytes) against a step, both timed at start-up (``prepare``, the
probe of Streaming's ``--tau auto`` and SparseLoCo's ``--H auto``; the slowest worker decides),
a period late where nothing shorter hides it, and a period late also where no probe ran
(``geotrain.wrap`` without ``profile=``). The choice is saved in the algorithm's state: a resume
and an adopter keep it. Measured and not taken (``tiny``, seed 0, a period late): the eager
start's share w of the own pseudo-gradient (``eager_weight``) at 0, 0.5, 1.5 and 2 gives 2.880,
2.263, 2.190 and 2.351 against 1's 2.120, and the least-squares share <mean, own> / |own|^2 of
the last period landed (0.32-0.38 on W1 after its warm-up) 2.154, and +2.5% on W1 at step 200;
Kale et al.'s own form (each replica's outer optimizer fed its own pseudo-gradient / N plus the
others' of a period before) 2.41 (alpha 1, beta 0: 2.22); with that least-squares share, a
Nesterov outer step 2.133, beta 0.3 2.136, alpha 1 with beta 0 (the delayed plain average) 2.116.

The all-reduce is the one periodic averaging already uses, in fp32 (``comm.all_reduce``; in two
levels with ``--hierarchy``). With ``bits`` 4 or 8 each worker's Delta travels quantised instead
(``sync/quantized_gather.py``, Streaming DiLoCo's messages: an fp32 scale per 256 values),
all-gathered and averaged in fp32 after decoding, with error feedback: what a message's rounding
lost is added to the next one (the eager start takes the fp32 Delta). Gathered among N that is
N / 16 of the fp32 ring's bytes with int4 (1/4 at 4 workers). ``finalize`` lands the message in
flight and, inside a period, takes one last synchronous outer step for its steps (and with
``bits``, what the last message's rounding lost), so the run ends with one model.

Memory: the anchor, the momentum, and the message in flight (three copies of the parameters);
with ``bits``, the error feedback's residual and the eager start besides, the message an eighth.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from geotrain.comm.buckets import flat_copy, unflatten_into
from geotrain.plan.gather import hiding_steps
from geotrain.plan.profile import time_all_reduce, time_gather
from geotrain.sync.auto_tau import AutoTau
from geotrain.sync.base import InFlight, PeriodicSync, SyncConfig, own_value, require, require_period
from geotrain.sync.quantized_gather import BITS, QuantizedGather

PROBE_BYTES = 1 << 20  # --tau auto times an exchange of at most this much, and scales it


@dataclass
class CO2Config(SyncConfig):
    H: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    gap_penalty: float = 1.0
    clip: float = 1.0
    eager: bool = True
    eager_weight: float = 1.0  # the share of its own Delta an eager start takes (docstring)
    bits: int = 4  # 4 or 8: quantised messages, gathered, with error feedback; 32: an fp32 all-reduce
    # steps into the next period at which a period's mean lands: H (a period late, the paper's),
    # 1 to H, or "auto": the fewest that hide 1.5 times the exchange timed at start-up (H until then)
    tau: int | str = "auto"
    tau_auto: bool = field(default=False, init=False, repr=False)  # tau was "auto": chosen by prepare

    def __post_init__(self) -> None:
        require_period(self.H)
        if self.tau == "auto":
            self.tau_auto, self.tau = True, self.H
        require(
            isinstance(self.tau, int) and not isinstance(self.tau, bool) and 1 <= self.tau <= self.H,
            f"--tau for co2 (steps into the next period at which a period's mean lands) must be auto "
            f"or in [1, H] = [1, {self.H}], got {self.tau}",
        )
        require(self.bits in BITS, f"--bits for co2 must be one of {BITS}, got {self.bits}")
        require(self.outer_lr > 0, f"--outer-lr must be > 0, got {self.outer_lr}")
        require(
            0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}"
        )
        require(
            self.gap_penalty >= 1,
            f"--gap-penalty (lambda, dividing the stale pseudo-gradient) must be >= 1, "
            f"got {self.gap_penalty}",
        )
        require(self.clip >= 0, f"--clip (outer momentum threshold; 0: off) must be >= 0, got {self.clip}")
        weight = self.eager_weight
        require(
            isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 <= weight <= 2,
            f"--eager-weight must be a number in [0, 2], got {weight!r}",
        )
        require(self.eager or weight == 1, "--eager-weight needs --eager (it weighs the eager start)")


class CO2(AutoTau, PeriodicSync):
    name = "co2"

    def __init__(self, model, optimizer, comm, config: CO2Config | None = None) -> None:
        super().__init__(model, optimizer, comm, config or CO2Config())
        self._anchor = self._local()  # A_k, equal on every worker
        self._start = self._anchor  # where this period started (eager: A_k - own Delta)
        self._momentum = torch.zeros_like(self._anchor)  # m, equal on every worker
        cfg = self.config
        # this worker's Delta, landing tau steps late: an fp32 mean all-reduce, or with --bits 4
        # or 8 quantised messages gathered and averaged after decoding, with error feedback
        self.messages = QuantizedGather(comm, cfg.bits) if cfg.bits < 32 else None
        # (keeps the last landed result for a survivor whose wait for it failed: the gathered
        # messages, N eighths of the model in 4 bits; with fp32 a copy of the model)
        self.in_flight = InFlight(comm, op="mean" if self.messages is None else "gather", keeps_landed=True)
        # fp32 whatever the parameters' dtype: what a message's rounding lost, not a parameter
        self._residual = (
            torch.zeros(self._anchor.numel(), dtype=torch.float32, device=self._anchor.device)
            if self.messages is not None
            else None
        )
        self._final_delta: torch.Tensor | None = None  # finalize's, kept for a retry
        self._init_auto_tau()

    # -- --tau auto (AutoTau) ------------------------------------------------------------------
    def prepare(self, loss_fn) -> None:
        """--tau auto: time whole steps and one exchange of the run's size (the gather of a
        quantised message, or the fp32 all-reduce), and land each period's mean the fewest
        steps into the next that hide 1.5 times it (H, a period late, at most)."""
        if self.config.tau_auto and self.tau_choice is None and self.config.H == 1:
            self.tau_choice, self.tau_taken = {}, "H is 1"  # nothing to choose: the next step
            return  # is the next period
        super().prepare(loss_fn)

    def _tau_from(self, compute_s: float, exchange_s: float) -> int:
        return hiding_steps(compute_s, exchange_s, self.config.H)

    def _tau_said(self) -> str:
        return f"each period's mean lands {self.config.tau} of {self.config.H} steps into the next"

    def _time_exchange(self) -> float:
        """The seconds of one exchange of the run's size (the gather of a message, or the fp32
        all-reduce), timed on zeros of at most PROBE_BYTES and scaled by the bytes: the whole
        model's exchange would hold the start for as long as an outer step's (minutes on a slow
        link), and a slow link's time grows with the bytes."""
        n = self._anchor.numel()
        nbytes = self.messages.payload_bytes(n) if self.messages is not None else 4 * (n + 1)
        probe = min(nbytes, PROBE_BYTES)
        if self.messages is not None:
            seconds = time_gather(self.comm, probe, self.device)
        else:
            seconds = time_all_reduce(self.comm, probe // 4, self.device)
        return seconds * nbytes / probe

    def _local(self) -> torch.Tensor:
        return flat_copy([p.detach() for p in self.parameters()])

    def _set_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            unflatten_into(flat, [p.data for p in self.parameters()])

    def _outer_update(self, mean_delta: torch.Tensor) -> None:
        """m <- beta m + Delta / lambda, clamped to +-phi; A <- A - alpha m."""
        cfg = self.config
        self._momentum.mul_(cfg.outer_momentum).add_(mean_delta, alpha=1 / cfg.gap_penalty)
        if cfg.clip > 0:
            self._momentum.clamp_(-cfg.clip, cfg.clip)
        self._anchor.sub_(self._momentum, alpha=cfg.outer_lr)

    def _land_in_flight(self) -> None:
        landed = self.in_flight.land()
        if landed is not None and self.messages is not None:  # the gathered messages, decoded
            with self.in_flight.rows_judged():  # (rows kept from the group before: theirs)
                landed, kept = self.messages.mean(landed, self._anchor.numel())
            own = self.in_flight.own_row(len(kept))  # (a result kept from the group before: its row)
            if own is not None and not kept[own]:  # left out: what its rounding lost goes too
                self._residual.zero_()
        if landed is not None:
            self._outer_update(landed)

    def _launch(self, delta: torch.Tensor) -> None:
        if self.messages is None:
            if self.contributes():
                self.in_flight.launch(delta)
            else:  # a copy of the leader's (an average redone after a regroup): it weighs nothing
                self.in_flight.launch_weighted(delta.new_zeros(delta.numel() + 1))
            return
        if not self.contributes():  # all zero bytes: left out of the mean
            self.in_flight.launch(self.messages.empty(delta.numel(), delta.device))
            return
        # the next residual is kept once the message is on its way (a launch that fails is sent
        # again from this one)
        message, residual = self.messages.encode_with_feedback(delta, self._residual)
        spoiled = self.comm.spoiled(delta)  # --chaos corrupt: the error feedback stays the honest one's
        if spoiled is not None:
            message = self.messages.encode_with_feedback(spoiled, self._residual)[0]
        self.in_flight.launch(message)
        self._residual = residual

    def _eager_start(self, delta: torch.Tensor) -> torch.Tensor:
        """The next period's start: the anchor, or with ``eager`` the anchor moved by this
        worker's own pseudo-gradient, standing in for the mean still in flight."""
        if not self.config.eager:
            return self._anchor
        cfg = self.config
        return self._anchor - (cfg.eager_weight * cfg.outer_lr / cfg.gap_penalty) * delta

    def outer_step(self) -> None:
        if self._start is self._anchor:  # (no eager) the landing below moves the anchor in place:
            self._start = self._anchor.clone()  # a retry after a failed launch takes the same delta
        delta = self._start - self._local()
        # The last period's message: if its wait fails (a lost member), nothing here has changed
        # and ``retry_sync`` sends it again on the new group.
        self._land_in_flight()
        self._launch(delta)
        self._start = self._eager_start(delta)
        self._set_params(self._start)
        self.syncs += 1

    synchronize = outer_step

    # -- landing inside the period ----------------------------------------------------------------
    def after_step(self) -> bool:
        synced = super().after_step()
        if not synced and self._lands_now():
            self._land_early()
        return synced

    def _lands_now(self) -> bool:
        # outer steps are at every H-th step (co2 has no warm start or H schedule), so the steps
        # since the last one are the step count's remainder; tau = H lands at the outer step
        tau = self.config.tau
        return tau < self.config.H and self.step_count % self.config.H == tau and self.in_flight.flying

    def retry_sync(self, adopters: Collection[int] = ()) -> None:
        super().retry_sync(adopters)
        if self._lands_now():  # this step's landing failed with the group: land on the new one
            self._land_early()

    def _land_early(self) -> None:
        """``tau`` steps into the period: the last period's mean lands in the anchor (the outer
        step), and this worker's stand-in for it (its own pseudo-gradient, in the period's
        start) is replaced by it: x <- x + (new anchor - start). The rest of the period trains
        from where a synchronous outer step would have put it, plus the tau steps taken since;
        the next pseudo-gradient is still the whole period's progress (start - x)."""
        start = self._start.clone() if self._start is self._anchor else self._start  # (no eager)
        self._land_in_flight()  # if its wait fails, nothing here has changed
        moved = self._anchor - start
        self._start = self._anchor.clone()
        self._set_params(self._local() + moved)

    def finalize(self) -> None:
        """Land the message in flight, then (inside a period) one last, synchronous, outer step
        for this period's steps, whose pseudo-gradient is taken from the anchor they started
        from, before the landing moves it. Safe to call again after a failed collective: the
        pseudo-gradient is kept, and a message that landed is not landed twice."""
        if self._final_delta is None:
            self._final_delta = None if self.at_boundary() else self._start - self._local()
            if self._final_delta is not None and self._residual is not None:  # what rounding lost
                self._final_delta += self._residual
                self._residual.zero_()
        self._land_in_flight()
        if self._final_delta is not None:
            self._outer_update(self.comm.all_reduce(self._final_delta.clone(), op="mean"))
            self._final_delta = None
        self._start = self._anchor
        self._set_params(self._anchor)

    def close(self) -> None:
        self.in_flight.close()

    def rebind(self) -> None:
        self.in_flight.rebind()  # a lost worker's part of the mean in flight is lost with it

    places_by_message = True  # its mean launched at an outer step, landing tau steps on

    # An adopter starts from the anchor (below): a hand-over carries no parameters, which between
    # syncs are each worker's own (an eager start, the steps since).
    parameters_from_state = True

    def adopted_state(self) -> None:
        self.in_flight.adopted()  # the message it loaded is the other worker's
        if self._residual is not None:
            self._residual.zero_()  # and so is what its rounding lost
        # Its stand-in for the mean in flight is its own message, which is empty: its period
        # starts from the anchor, and so do its parameters (the other worker's progress since
        # the last outer step, kept, would count twice in both workers' next Delta).
        self._start = self._anchor.clone()
        self._set_params(self._anchor)

    @property
    def measures_noise(self) -> bool:  # type: ignore[override]
        # --lr-scale auto needs a period's first step taken from common parameters: not eager's
        return not self.config.eager

    def shared_state(self) -> list[torch.Tensor]:
        return [self._anchor]  # an eager start is each worker's own

    def replicated_parts(self) -> set[str]:
        # Right after an outer step every worker starts from the anchor, but with ``eager``
        # from the anchor moved by its own pseudo-gradient; the message in flight (in "sync") is
        # each worker's own. (A snapshot that took an eager start for shared could not rebuild a
        # lost host from its peers: tests/test_replicated_gloo.py.)
        shared = self.at_boundary() and self.step_count > self.warm_start and not self.config.eager
        return {"model"} if shared else set()

    def info(self) -> str:
        n, H, tau = self._anchor.numel(), self.config.H, self.config.tau
        steps = "1 step" if tau == 1 else f"{tau} steps"
        late = "one period late" if tau == H else f"landing {steps} into the next period"
        if self.messages is None:
            return f"outer all-reduce of {4 * n:,} bytes per worker every {H} steps, {late}"
        message = f"{self.config.bits}-bit messages of {self.messages.payload_bytes(n):,} bytes"
        return f"outer all-gather of {message} per worker every {H} steps, {late}"

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["anchor"] = self._anchor
        state["momentum"] = self._momentum
        # A resumed run sends this worker's message in flight again at its next outer step, so
        # N + stop + N lands the same bytes as 2N.
        state["in_flight"] = self.in_flight.saved()
        state["in_flight_result"] = self.in_flight.primed_result  # (kept at a regroup: lands it too)
        state["in_flight_hosts"] = self.in_flight.primed_hosts  # (its rows' hosts, for the check)
        # measured at start-up under auto: a resume and an adopter keep it
        state["tau"] = self.config.tau
        # where this period started: moved by this worker's fp32 Delta, which a 4-bit message in
        # flight holds only rounded, and an adopter's or a left-out worker's holds not at all.
        # This worker's alone ("own", as the residual): in its snapshots, never handed to an
        # adopter, who starts from the anchor (adopted_state)
        own = {"start": self._start}
        if self._residual is not None:
            own["residual"] = self._residual
        state["own"] = {**state.get("own", {}), **own}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._anchor.copy_(state["anchor"])
        self._momentum.copy_(state["momentum"])
        self._restore_tau(state, self.config.H)  # before co2 had a tau: a period late
        self.in_flight.restore(
            state["in_flight"], self.device, state.get("in_flight_result"), state.get("in_flight_hosts")
        )
        flying = self.in_flight.saved()
        start = own_value(state, "start")  # none handed over: the adopter starts from the anchor
        if start is not None:  # with nothing in flight too: a launch that failed left an eager start
            self._start = start.to(self._anchor).clone()
        elif flying is None or self.messages is not None:
            self._start = self._anchor
        else:  # fp32, saved before the start was: the message in flight is the Delta, weight last
            self._start = self._eager_start(flying[:-1])
        if self._residual is not None:
            saved = own_value(state, "residual")  # none handed over: an adopter's starts at zero
            self._residual.copy_(saved) if saved is not None else self._residual.zero_()
