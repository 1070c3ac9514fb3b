"""``streaming``: Streaming DiLoCo (Douillard et al., arXiv 2501.18512).

DiLoCo with three changes that shrink the peak bandwidth and hide the outer synchronisation:

1. **Fragments.** The model is split into P fragments (``fragments``) that synchronise in
   turn (fragment 0 first), one every H / P steps, so each fragment still synchronises every H
   steps but the link carries 1/P of the model at a time. Fragments are strided over the
   model's repeated blocks (block i goes to fragment i mod P), which the paper found slightly
   better than contiguous ones; each other module with parameters (an embedding, the final
   norm) then goes to the fragment that is smallest so far.
2. **Overlap.** A fragment's outer gradient is sent tau steps (``tau``) before it is needed:
   with s = H / P, fragment f = (k - 1) mod P lands at step k s, launched at step k s - tau,
   so its all-gather runs under tau steps of compute. At launch the worker's pseudo-gradient is
   Delta_f = theta_f - x_f (theta the global fragment, equal everywhere; x this worker's); at
   landing the outer optimizer (Nesterov SGD, as DiLoCo's) steps theta_f with the mean of the
   Delta_f, and the worker merges: x_f <- alpha x_f + (1 - alpha) theta_f (``mix``, the
   paper's alpha), keeping part of the tau steps it took meanwhile. tau = 0 synchronises in place;
   ``tau="auto"`` (ours) takes the fewest steps that hide 1.5 times a fragment's gather, timed at
   start-up (``prepare``), and keeps the choice in the state.
   With ``carry`` (ours, the default; as CO2's eager start keeps a worker's own progress) the
   worker instead takes x_f <- theta_f + (x_f - x_f at launch): the new global fragment plus
   exactly the tau steps it took while the message flew. The mix keeps alpha of each replica's
   drift from the others across the sync; carry keeps none of it, and loses none of the tau
   steps either. A given ``mix`` (or tau = 0, where nothing is in flight) turns it off.
3. **Quantised outer gradients.** Each Delta_f travels in ``bits`` = 4 bits (int4 with one
   fp32 scale per block of 256 values; the paper uses 4-bit floats, E3M0), gathered, and
   averaged in fp32 after decoding, as the paper accumulates in full precision. Each fragment
   keeps error feedback (not in the paper; CO2's messages have it too): what its message's
   rounding lost is added to its next one, so no part of a pseudo-gradient is lost for good to
   rounding toward zero. An all-gather
   among N sends N - 1 messages per worker, each 1/8 of fp32, against the 2 (N - 1) / N
   messages of DiLoCo's fp32 ring all-reduce: N / 16 of its bytes per fragment (1/4 at N = 4;
   beyond 16 workers the gather sends more, and ``bits`` 8 or an all-reduce would be better).

Defaults: H = 20 and P = 4 (a fragment every 5 steps), tau = 1, ``carry`` (where a mix is given,
alpha 0.5 as in the paper and torchft's ``fragment_update_alpha`` convention: alpha weighs the
local parameters; see docs/reaching-ddp-loss.md for carry against it on W1), the
outer learning rate 0.7 and momentum following H as DiLoCo's (``outer_momentum_for``), with
``momentum_ramp`` N (off by default, as DiLoCo's) each fragment's ramped to 0.9 over its own first
N outer steps (GPT ``tiny``, 4 workers, 2,000 steps, final validation loss at seeds 0 / 1: 1.5604
/ 1.8036 without, 1.5119 / 1.7368 with N=10); 0 <= tau
< H / P, as torchft requires, so one fragment at most is in flight. The schedule is torchft's
(``torchft.local_sgd.DiLoCo``), whose ``fragment_sync_delay`` is tau.

Sync boundaries (for the membership layer) are the steps where a fragment launches or lands:
every gcd(s, tau) steps (every step at tau = 1). So after a fault the survivors are treated as
lock-stepped: one that is behind the furthest adopts its whole state. A replica is never synced
in all its fragments at once, so an adopter (a joiner, a survivor behind) starts every fragment
from theta_f, not from the member's replica it loaded: the member's progress since each
fragment's last sync is the member's, and counts once, in the member's own Delta_f.

Memory: one copy of the parameters (theta) and the outer momentum, as DiLoCo; with ``bits`` 4 or
8 the error feedback's residuals besides (one more copy); with ``carry`` the fragment in flight's
parameters at its launch (1 / P of a copy).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.buckets import flat_copy, unflatten_into
from geotrain.plan.gather import streaming_tau
from geotrain.plan.profile import time_gather
from geotrain.sync.auto_tau import AutoTau
from geotrain.sync.base import InFlight, SyncAlgorithm, SyncConfig, require
from geotrain.sync.diloco import outer_momentum_for, ramped_momentum, require_momentum_ramp
from geotrain.sync.quantized_gather import BITS, QuantizedGather


@dataclass
class StreamingConfig(SyncConfig):
    H: int = 20
    fragments: int = 4
    # steps a fragment's sync overlaps; "auto": the fewest that hide its gather as timed at
    # start-up (``prepare``), 1 until then
    tau: int | str = 1
    mix: float | None = None  # None: 0.5 where carry is off (carry does not use it)
    outer_lr: float = 0.7
    outer_momentum: float | None = None  # None: follows H (diloco.outer_momentum_for)
    # where the momentum follows H: each fragment's rises to 0.9 over its first outer steps (diloco's)
    momentum_ramp: int = 0
    momentum_follows_H: bool = field(default=False, init=False, repr=False)
    bits: int = 4
    # at landing, the fragment becomes theta_f plus this worker's steps taken since its launch,
    # in place of the mix (every replica re-synchronised, none of the tau steps lost); None: on,
    # unless a mix is given or tau is 0
    carry: bool | None = None
    tau_auto: bool = field(default=False, init=False, repr=False)  # tau was "auto": chosen by prepare

    def __post_init__(self) -> None:
        require(
            isinstance(self.fragments, int) and self.fragments >= 1,
            f"--fragments must be an integer >= 1, got {self.fragments}",
        )
        require(
            isinstance(self.H, int) and self.fragments <= self.H and self.H % self.fragments == 0,
            f"H (steps between two syncs of one fragment) must be a multiple of --fragments "
            f"{self.fragments}, got {self.H}",
        )
        s = self.H // self.fragments
        if self.tau == "auto":  # chosen at start-up; 1 until then (0 where no step can overlap)
            self.tau_auto, self.tau = s > 1, min(1, s - 1)
        require(
            isinstance(self.tau, int) and 0 <= self.tau < s,
            f"--tau (steps a fragment's sync overlaps) must be auto or in [0, H / fragments) = "
            f"[0, {s}), got {self.tau}: raise H or lower --fragments",
        )
        require(
            not (self.carry and self.mix is not None),
            "--carry replaces --mix (the local parameters' weight at a landing): give one of them",
        )
        require(
            not (self.carry and self.tau == 0),
            "--carry keeps the steps taken while a fragment's sync is in flight, and at --tau 0 there "
            "are none (it would be --mix 0): raise --tau or drop --carry",
        )
        if self.carry is None:
            self.carry = self.mix is None and self.tau > 0
        if self.mix is None and not self.carry:
            self.mix = 0.5
        require(
            self.mix is None or 0 <= self.mix <= 1,
            f"--mix (weight of the local parameters) must be in [0, 1], got {self.mix}",
        )
        require(self.outer_lr > 0, f"--outer-lr must be > 0, got {self.outer_lr}")
        if self.outer_momentum is None:
            self.momentum_follows_H = True
            self.outer_momentum = outer_momentum_for(self.H, self.outer_lr)
        require(
            0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}"
        )
        require_momentum_ramp(self.momentum_ramp)
        require(self.bits in BITS, f"--bits for streaming must be one of {BITS}, got {self.bits}")

    @property
    def every(self) -> int:
        """s = H / P: steps between two fragments' syncs."""
        return self.H // self.fragments


def fragment_units(model: nn.Module) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """The model's parameters in units, in registration order: (blocks, others). Each element of
    its repeated blocks (the largest ``nn.ModuleList`` or ``nn.Sequential`` of modules of one
    type) is a block unit; each other module that owns parameters (an embedding, the final norm)
    is another unit."""
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and len({type(c) for c in m}) == 1
    ]
    prefix, _ = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()), default=("", None))
    blocks: dict[str, list[nn.Parameter]] = {}
    others: list[list[nn.Parameter]] = []
    seen: set[int] = set()  # a tied parameter (head and embedding) in one unit only
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if not params:
            continue
        if prefix and name.startswith(prefix + "."):
            block = ".".join(name.split(".")[: prefix.count(".") + 2])
            blocks.setdefault(block, []).extend(params)
        else:
            others.append(params)
    return list(blocks.values()), others


def strided_fragments(model: nn.Module, count: int) -> list[list[nn.Parameter]]:
    """``count`` fragments: block i in fragment i mod count (strided, as the paper's), then each
    other unit (largest first) in the fragment that is smallest so far."""
    blocks, others = fragment_units(model)
    require(
        len(blocks) + len(others) >= count,
        f"--fragments {count} is more than the model's {len(blocks) + len(others)} units (blocks "
        "and other parameter-owning modules): lower --fragments",
    )
    fragments: list[list[nn.Parameter]] = [[p for u in blocks[f::count] for p in u] for f in range(count)]
    for unit in sorted(others, key=lambda u: -sum(p.numel() for p in u)):
        smallest = min(range(count), key=lambda f: (sum(p.numel() for p in fragments[f]), f))
        fragments[smallest].extend(unit)
    require(all(fragments), f"--fragments {count} leaves a fragment empty: lower --fragments")
    return fragments


class StreamingDiLoCo(AutoTau, SyncAlgorithm):
    local_steps = True
    name = "streaming"

    def __init__(self, model, optimizer, comm, config: StreamingConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or StreamingConfig())
        cfg = self.config
        self.fragments = strided_fragments(model, cfg.fragments)
        # theta per fragment, one flat tensor each, and its outer optimizer
        self._global = [flat_copy([p.detach() for p in frag]) for frag in self.fragments]
        self.outer_optimizers = [
            torch.optim.SGD(
                [theta], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0
            )
            for theta in self._global
        ]
        self.messages = QuantizedGather(comm, cfg.bits)  # Delta_f in ``bits`` bits, averaged in fp32
        self.in_flight = InFlight(comm)  # this worker's Delta of the fragment in flight
        # per fragment, what its last message's rounding lost, added to its next (error feedback)
        # (fp32 whatever the parameters' dtype: what a message's rounding lost, not a parameter)
        self._residual = (
            [torch.zeros(t.numel(), dtype=torch.float32, device=t.device) for t in self._global]
            if cfg.bits < 32
            else None
        )
        self._final_stage = -1  # finalize: -1 before its landing, then the fragment it averages
        self._final_landed = False  # finalize landed a message in flight (a collective) first
        # carry: x_f at the launch of the fragment in flight (``_in_flight_fragment``)
        self._launched_from: torch.Tensor | None = None
        self._init_auto_tau()

    # -- --tau auto (AutoTau) ------------------------------------------------------------------
    exchange_named = "a fragment's gather"

    def _time_exchange(self) -> float:
        """One all-gather of the largest fragment's message (zeros, its size)."""
        largest = max(t.numel() for t in self._global)
        return time_gather(self.comm, self.messages.payload_bytes(largest), self.device)

    def _tau_from(self, compute_s: float, exchange_s: float) -> int:
        """The fewest steps that hide 1.5 times the gather (``streaming_tau``)."""
        return streaming_tau(compute_s, exchange_s, self.config.every)

    def _tau_said(self) -> str:
        return f"tau={self.config.tau} of at most {self.config.every - 1}"

    # -- the schedule -----------------------------------------------------------------------------
    def _landing(self, step: int) -> int | None:
        """The fragment that lands after ``step`` (counted from 1), if one does."""
        s = self.config.every
        return (step // s - 1) % self.config.fragments if step % s == 0 and step > 0 else None

    def _launching(self, step: int) -> int | None:
        """The fragment launched after ``step``: the one landing tau steps later."""
        return self._landing(step + self.config.tau)

    def sync_period(self) -> int:
        return math.gcd(self.config.every, self.config.tau) if self.config.tau else self.config.every

    def default_snapshot_every(self) -> int:
        return self.snapshot_boundary(self.config.H)

    def _local(self, f: int) -> torch.Tensor:
        return flat_copy([p.detach() for p in self.fragments[f]])

    def _launch(self, f: int) -> None:
        local = self._local(f)
        delta = self._global[f] - local
        residual = None if self._residual is None else self._residual[f]
        message, next_residual = self.messages.encode_with_feedback(delta, residual)
        spoiled = self.comm.spoiled(delta)  # --chaos corrupt: the error feedback stays the honest one's
        if spoiled is not None:
            message = self.messages.encode_with_feedback(spoiled, residual)[0]
        self.in_flight.launch(message)
        # kept once the message is on its way (a retry sends it again from the residual before)
        if self._residual is not None:
            self._residual[f] = next_residual
        if self.config.carry:
            self._launched_from = local

    def _land(self, f: int) -> None:
        gathered = self.in_flight.land()
        if gathered is None:  # nothing in flight (a resumed run's first landing, say)
            return
        theta = self._global[f]
        # The mean in theta's device and dtype (a grad must match its tensor's: bf16 parameters)
        mean, kept = self.messages.mean(gathered, theta.numel())
        own = self.in_flight.own_row(len(kept))
        if self._residual is not None and own is not None and not kept[own]:  # left out: its rounding too
            self._residual[f].zero_()
        theta.grad = mean.to(theta)
        cfg = self.config
        if cfg.momentum_follows_H:  # landings come in turn: fragment f has taken syncs // P before
            momentum = ramped_momentum(cfg.outer_momentum, self.syncs // cfg.fragments, cfg.momentum_ramp)
            self.outer_optimizers[f].param_groups[0]["momentum"] = momentum
        self.outer_optimizers[f].step()
        theta.grad = None
        launched, self._launched_from = self._launched_from, None  # set under carry only
        if launched is not None:  # theta_f + (x_f - x_f at launch)
            merged = self._local(f).sub_(launched).add_(theta)
        else:
            mix = self.config.mix or 0.0  # carry with nothing to carry (a state saved without it): theta_f
            merged = self._local(f).mul_(mix).add_(theta, alpha=1 - mix)
        with torch.no_grad():
            unflatten_into(merged, [p.data for p in self.fragments[f]])
        self.syncs += 1

    def after_step(self) -> bool:
        super().after_step()
        return self._sync_at(self.step_count)

    def _sync_at(self, step: int) -> bool:
        landing, launching = self._landing(step), self._launching(step)
        if landing is not None and self.config.tau == 0:
            self._launch(landing)  # no overlap: sent and landed in this step
        if landing is not None:
            self._land(landing)  # first: tau < H / P, so its message is the one in flight
        if launching is not None and self.config.tau > 0:
            self._launch(launching)
        return landing is not None

    def retry_sync(self, adopters: Collection[int] = ()) -> None:
        # The collective that failed was this step's landing (a launch only waits at landing):
        # ``rebind`` kept the message, which ``_land`` sends again on the new group. An adopter's
        # is empty already (``InFlight.adopted``): ``adopters`` needs no weighing here.
        step = self.step_count
        if self.in_flight.flying and self._landing(step) is not None:
            self._land(self._landing(step))
            if self._launching(step) is not None and self.config.tau > 0:
                self._launch(self._launching(step))

    def finalize(self) -> None:
        """Land the fragment in flight, then make one model: each fragment becomes the mean of
        the replicas (theta_f minus the mean of the Delta_f, in ``bits`` bits, no outer step), so
        what every worker did since its fragment's last sync counts once. Safe to call again
        after a failed collective: it goes on from the stage it reached, and ``rebind`` keeps the
        message of that stage, which ``land`` sends again. With ``bits`` 4 or 8 each message
        carries what its fragment's last one's rounding lost, at weight 1 as its Delta_f."""
        if self._final_stage < 0:
            if self.in_flight.flying:
                self._land(self._in_flight_fragment())
                self._final_landed = True
            self._final_stage = 0
        while self._final_stage < len(self._global):
            f = self._final_stage
            theta = self._global[f]
            if not self.in_flight.flying and not self.contributes():
                # A copy of the leader's state (an average redone after it adopted): its replica
                # is theta, and its zero Delta_f, quantised, would still count (int4 codes zero
                # as 8) and halve the others'. All zero bytes are left out of the mean.
                self.in_flight.launch(self.messages.empty(theta.numel(), theta.device))
            elif not self.in_flight.flying:  # with what the fragment's last rounding lost
                residual = None if self._residual is None else self._residual[f]
                self.in_flight.launch(self.messages.encode_with_feedback(theta - self._local(f), residual)[0])
                if residual is not None:
                    residual.zero_()
            mean = self.messages.mean(self.in_flight.land(), theta.numel())[0].to(theta.device)
            # theta_f becomes the fragment's final value too: a worker that adopts this one's
            # state (its own average failed) rebuilds its parameters from theta (adopted_state)
            theta.sub_(mean)
            with torch.no_grad():
                unflatten_into(theta, [p.data for p in self.fragments[f]])
            self._final_stage += 1

    def final_progress(self) -> int:
        # the collectives it completed: the message in flight landed (if one flew), each fragment's
        return max(0, self._final_stage) + int(self._final_landed)

    def close(self) -> None:
        self.in_flight.close()

    def rebind(self) -> None:
        self.in_flight.rebind()

    # An adopter's parameters are the global fragments (below): a hand-over carries none.
    parameters_from_state = True

    def adopted_state(self) -> None:
        self.in_flight.adopted()
        for residual in self._residual or []:
            residual.zero_()  # what the other worker's rounding lost is the other worker's
        # The replica loaded holds the other worker's progress since each fragment's last sync;
        # kept, it would count twice, in both workers' Delta_f at that fragment's next landing.
        with torch.no_grad():
            for theta, fragment in zip(self._global, self.fragments, strict=True):
                unflatten_into(theta, [p.data for p in fragment])
        self._launched_from = None
        if self.config.carry and self.in_flight.flying:  # its steps from here on are what it carries
            self._launched_from = self._global[self._in_flight_fragment()].clone()

    def _in_flight_fragment(self) -> int:
        """The fragment of the message in flight: the next to land (a landing that failed at
        this step is this step's; a launch is never at a landing step, tau < H / P)."""
        s = self.config.every
        return self._landing(-(-self.step_count // s) * s)

    def shared_state(self) -> list[torch.Tensor]:
        return list(self._global)  # the replicas never: each fragment lands at its own step

    def replicated_parts(self) -> set[str]:
        return set()  # the fragments are never all equal at once: each worker's own

    def info(self) -> str:
        sizes = [t.numel() for t in self._global]
        payload = [self.messages.payload_bytes(n) for n in sizes]
        return (
            f"{self.config.fragments} fragments, one every {self.config.every} steps, landing "
            f"{self.config.tau} step(s) late; {self.config.bits}-bit messages of "
            f"{min(payload):,}-{max(payload):,} bytes per worker"
        )

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["global"] = list(self._global)
        state["outer_optimizers"] = [o.state_dict() for o in self.outer_optimizers]
        state["in_flight"] = self.in_flight.saved()
        state["tau"] = self.config.tau  # as --tau auto chose it: a resume and an adopter keep it
        if self._final_stage >= 0:  # inside finalize: an adopter goes on from this stage
            state["final_stage"] = self._final_stage
            state["final_landed"] = self._final_landed
        # This worker's alone ("own"): kept in its snapshots, never handed to an adopter over the
        # link (a model's worth of residuals that the adopter would drop).
        own = {}
        if self._residual is not None:
            own["residual"] = list(self._residual)
        if self._launched_from is not None:  # a fragment in flight (cleared where it lands)
            own["launched_from"] = self._launched_from
        if own:
            state["own"] = {**state.get("own", {}), **own}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for dst, src in zip(self._global, state["global"], strict=True):
            dst.copy_(src)
        for opt, saved in zip(self.outer_optimizers, state["outer_optimizers"], strict=True):
            opt.load_state_dict(saved)
        self._restore_tau(state, 1)
        self._final_stage = state.get("final_stage", -1)
        self._final_landed = state.get("final_landed", self._final_stage >= 0)
        self.in_flight.restore(state["in_flight"], self.device)
        own = state.get("own", {})  # absent where another worker handed the state over
        saved = own.get("residual")
        for f, residual in enumerate(self._residual or []):
            residual.copy_(saved[f]) if saved is not None else residual.zero_()
        launched = own.get("launched_from") if self.config.carry else None  # where it left from
        self._launched_from = None if launched is None else launched.to(self.device).clone()
