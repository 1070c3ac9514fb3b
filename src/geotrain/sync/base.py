"""What every sync algorithm is: a wrapper around an unchanged model and its optimizer.

The training loop calls, per step::

    loss = sync.model(x, y)[1]; loss.backward()
    sync.before_step()      # e.g. wait for gradient all-reduces launched during backward
    optimizer.step(); optimizer.zero_grad()
    sync.after_step()       # e.g. average parameters every H steps

and ``sync.finalize()`` once at the end, so that the model saved is one model. Algorithms
reach the network only through the injected ``Communicator``; they never read ``RANK`` or
create process groups.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Collection
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn

from geotrain.comm.buckets import flatten, reduce_tensors, unflatten_into
from geotrain.comm.communicator import Communicator
from geotrain.compress import plain_spec
from geotrain.compress.codec import Codec, ConfigError, make_codec
from geotrain.sync.pace import PACES, TimePace
from geotrain.sync.periods import periods_for

if TYPE_CHECKING:
    from geotrain.sync.noise import NoiseScale

# Steps between a periodic method's snapshots at least: those of a per-step method (every 50),
# so that no method's default pays more for them. One costs W1's 4 workers (1.1 s steps) about
# 0.7 s on the training thread and 0.4 s of a shared core in the background: every 5 steps
# (SparseLoCo's H=5) that was 6% of the step and more, every 20 steps 5% (SparseLoCo's outer
# steps at 3.5 Mbit/s 0.5 s longer than nosync's steps, the snapshot's share 0.18 s); a failure
# redoes at most max(50, H) steps, rounded up to a whole period.
MIN_SNAPSHOT_EVERY = 50


@dataclass
class SyncConfig:
    """Base for each algorithm's config. Subclasses validate in ``__post_init__``."""

    # The (inner) optimizer's learning rate when --lr is not given: AdamW's, for the methods that
    # step with it. A ClassVar, not a field: it is the training loop's, not an option here.
    default_lr: ClassVar[float] = 1e-3
    # Whether ``--warmup auto`` gives this algorithm a warm-up (``train_config.warmup_for``).
    auto_warmup: ClassVar[bool] = True
    # ``lr_scale`` when none is given (geotrain.api: "1", "sqrt" or "auto"): the training
    # loop's too, so a ClassVar, as ``default_lr``.
    default_lr_scale: ClassVar[str] = "1"

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SyncConfig:
        """Build from generic options, ignoring those that belong to other algorithms."""
        names = {f.name for f in fields(cls) if f.init}
        return cls(**{k: v for k, v in options.items() if k in names and v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def require_period(H: int) -> None:
    """The period of a method with outer steps (diloco, sparseloco, co2)."""
    require(
        isinstance(H, int) and H >= 1,
        f"H (inner steps between outer steps) must be an integer >= 1, got {H}",
    )


def require_site_period(site_H: int, H: int) -> None:
    require(
        isinstance(site_H, int) and 0 <= site_H < H,
        f"--site-H (steps between averages inside a site) must be an integer in [0, H) = [0, {H}), "
        f"got {site_H}: 0 turns it off; a period of H or more is the sync across sites already",
    )


def require_pace(pace: str) -> None:
    require(pace in PACES, f"--pace must be one of {', '.join(PACES)}, got {pace!r}")


def require_warm_start(warm_start: int) -> None:
    require(
        isinstance(warm_start, int) and warm_start >= 0,
        f"warm_start (synchronous steps before the periodic ones) must be an integer >= 0, got {warm_start}",
    )


def own_value(state: dict[str, Any], key: str) -> Any:
    """A value of the worker's own part of a saved state (``"own"``: in its snapshots, never
    handed to an adopter, so None in a hand-over), or at the top level where a snapshot was
    made before it moved there."""
    return state.get("own", {}).get(key, state.get(key))


def codec_from_config(config: SyncConfig, chooses: bool = False) -> Codec | None:
    """The codec named by ``config.compress`` ("", "none" or absent: send uncompressed; "auto":
    none yet, the algorithm chooses one when it plans, ``DreamDDP``)."""
    spec = plain_spec(getattr(config, "compress", ""))
    if spec == "auto" and not chooses:
        raise ConfigError(
            f"--compress auto lets a planner choose the codec; {type(config).__name__} has none: name a codec"
        )
    return make_codec(spec) if spec and spec != "auto" else None


def adopt_mean_change(
    params: list[torch.Tensor], refs: list[torch.Tensor], changes: list[torch.Tensor]
) -> None:
    """x_ref <- x_ref + mean_k(x_k - x_ref), then x <- x_ref: how a compressed parameter average
    lands (``changes`` hold the mean change, the same on every worker, so replicas agree)."""
    with torch.no_grad():
        for p, ref, change in zip(params, refs, changes, strict=True):
            ref.add_(change)
            p.copy_(ref)


class SyncAlgorithm:
    name: ClassVar[str] = "base"
    # True where each worker's optimizer steps on its own gradient between averages (the local
    # methods), not on the average of the gradients (ddp, ssgd) or on an update shared by all
    # (demo): ``geotrain.wrap``'s ``lr_scale="sqrt"`` scales those steps (``local_lr_factor``).
    local_steps: ClassVar[bool] = False
    # Where ``lr_scale="auto"`` measures the gradient noise (sync/noise.py): the methods with a
    # period whose first step starts from the replicas' common parameters (or, DreamDDP's, from
    # parameters each averaged within the last period) and whose sync can carry the measure.
    measures_noise: ClassVar[bool] = False
    # False where communication happens inside a library call that cannot be timed apart from
    # compute (PyTorch DDP waits for its all-reduces inside backward).
    measures_blocked_time: ClassVar[bool] = True
    # True where ``compress="auto"`` is accepted: the algorithm's planner chooses the codec.
    chooses_codec: ClassVar[bool] = False

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator, config: SyncConfig
    ) -> None:
        self.module = model
        self.optimizer = optimizer
        self.comm = comm
        self.config = config
        # Algorithms whose config has ``compress`` send their messages through this codec.
        self.codec = codec_from_config(config, self.chooses_codec)
        self.step_count = 0
        self.syncs = 0
        # --lr-scale auto: this worker's measure of its gradients' noise (set by geotrain.wrap's Sync)
        self.noise: NoiseScale | None = None
        self.broadcast_parameters()

    def notice(self, text: str) -> None:
        """One line to the user on stderr, from rank 0 alone: every worker takes the same
        decisions (a period, a verdict, a codec), so one says so for all."""
        if self.comm.rank == 0:
            print(f"geotrain: {text}", file=sys.stderr, flush=True)

    @property
    def model(self) -> nn.Module:
        """The module to call forward on (the wrapper, where an algorithm needs one)."""
        return self.module

    def steps_locally(self) -> bool:
        """The step under way is each worker's own optimizer step on its own gradient, in a
        group of more than one (``local_steps``; not a warm start's synchronous step)."""
        return self.local_steps and self.comm.world_size > 1

    def local_lr_factor(self) -> float:
        """sqrt(N) where ``steps_locally()``, else 1: what ``lr_scale="sqrt"`` multiplies the
        learning rate of this step by. Adam's step is its momentum over the root of its second
        moment; a worker's gradient over 1/N of the global batch has about N times the variance
        of DDP's averaged one, so where noise dominates the second moment, the mean of the N
        workers' steps is DDP's step at lr / sqrt(N) (docs/reaching-ddp-loss.md)."""
        return math.sqrt(self.comm.world_size) if self.steps_locally() else 1.0

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def broadcast_parameters(self) -> None:
        """Start every replica from rank 0's parameters, as DDP does, but move them only if some
        replica differs: workers that built the model from the same seed compare an 8-byte digest
        instead (at 350 kbit/s, ``mini``'s 43 MB from one host would take 17 minutes)."""
        self.startup_broadcast_bytes = 0
        if self.comm.world_size == 1:
            return
        params = [p.data for p in self.module.parameters()]
        flat = flatten(params)
        if self.comm.same_everywhere(flat):
            return
        self.startup_broadcast_bytes = flat.numel() * flat.element_size()
        unflatten_into(self.comm.broadcast(flat, src=0), params)

    def prepare(self, loss_fn) -> None:
        """Once before training, with a closure that computes a training loss (for profiling)."""

    def prepare_unprofiled(self) -> None:
        """Once before training where no such closure is given (``geotrain.wrap`` without
        ``profile=``): what the algorithm does instead of profiling, if anything."""

    def contributes(self) -> bool:
        """Whether this worker's contribution enters the average under way: not where it holds a
        copy of the leader's (an average redone after a regroup, ``Communicator.leaving_out``)."""
        return self.comm.rank not in self.comm.left_out

    def computes_step(self) -> bool:
        """Before the step under way: whether this worker computes it (forward, backward and
        update). False for the steps a straggler skips under ``--pace time`` (``sync.pace``):
        the loop then calls ``after_step`` alone, which makes any sync the step holds."""
        return True

    def workers_computing(self) -> int:
        """How many workers compute the step under way (the tokens it trains), the same number
        on every worker."""
        return self.comm.world_size

    def defers_admission(self) -> bool:
        """Whether a joiner may receive the members' state while they train on to their next
        sync, where it joins them (``ft/elastic.py``): only where no collective comes between
        two syncs, so that the members meet the joiner nowhere before."""
        return False

    def before_step(self) -> None:
        """After backward, before ``optimizer.step()``."""

    def after_step(self) -> bool:
        """After ``optimizer.step()``. Returns True when this step synchronised the replicas."""
        self.step_count += 1
        return False

    def finalize(self) -> None:
        """Leave one model: average replicas that may still differ."""

    def close(self) -> None:
        """Remove hooks."""

    def rebind(self) -> None:
        """The communicator now talks over a new membership epoch's group (``--on-failure
        continue``): drop what was bound to the old one (handles in flight, a DDP wrapper) and
        adapt to the new worker count. Called on every member at once, so it may communicate."""

    def settle(self) -> None:
        """This worker's step is complete (or a regroup has agreed where it goes on): what its
        messages changed of the state every worker holds equal stays, whatever fails later."""
        if self.codec is not None:
            self.codec.settle()

    def roll_back(self) -> None:
        """A failure cut this worker's step short, before a regroup: the state every worker
        holds equal goes back to what its last complete step left (``Codec.roll_back``), so the
        survivors, each cut short at its own point, redo the step or meet its sync alike."""
        if self.codec is not None:
            self.codec.roll_back()

    def land_in_flight(self) -> None:
        """Every member is at one step boundary of a group that is whole (an admission agreed
        there, before the regroup): what the last step left in flight on it lands now, on every
        member alike, and the step is settled with it. A regroup forgets what flies (it may be
        for a lost peer), and it would otherwise be dropped everywhere. Nothing by default: the
        messages an algorithm keeps in flight across a sync (``in_flight``) are the regroup's to
        land or send again."""

    in_flight: InFlight | None = None  # a message whose collective lands later, where one is
    # Whether a regroup may place this worker by the message it puts on the wire first in the
    # new group (``ft.elastic._places``): its message in flight's period where that must be sent
    # again, else the next sync's. True where every message in flight is launched at a sync
    # and lands at a fixed step of the period after it (SparseLoCo, CO2). A landing inside a
    # period waits for the collective, or sends it again after a regroup, so a survivor past it
    # and one before it must not go on each from its own step (one would land alone); the
    # regroup tells them apart by that message, and the collective period stays H: survivors on
    # the same side of the landing go on each from its own step, and a joiner is admitted while
    # the members train on (``defers_admission``), sending an empty message at the landing. (With
    # a period of gcd(H, landing), often 1, every admission stopped the members for a model's
    # worth of the link and every survivor short of the furthest took its whole state: under a
    # kill every 20 s at 300 kbit/s SparseLoCo stood still for minutes.)
    places_by_message = False

    def final_progress(self) -> int:
        """How many collectives of its end-of-run average (``finalize``) this worker has
        completed, where the average takes several in turn (Streaming DiLoCo's fragments): a
        regroup inside it makes the survivor furthest in it the leader (``ft/elastic.py``), or
        the others would redo different stages. 0 where it is one collective (or not begun)."""
        return 0

    def retry_sync(self, adopters: Collection[int] = ()) -> None:
        """Redo this step's synchronisation, which failed after the local optimizer step (the
        periodic methods' averaging at a sync boundary), on the new group. ``adopters``: the
        group ranks that have just loaded the leader's state (a joiner, a member behind); what
        they contribute is the leader's, so an average must not count it again."""

    def info(self) -> str:
        """What the algorithm (its codec) decided at run time, for the summary; "" if nothing."""
        return self.codec.info() if self.codec else ""

    def resolved_options(self) -> dict[str, Any]:
        """The options its config left to be decided (a 0 for "the default", an "auto") as the
        run took them, for the summary's ``algo_config``; {} where every option is as given."""
        return {}

    def adopted_state(self) -> None:
        """This worker has just loaded another worker's state (``ft/handover.py``'s hand-over to a
        joiner or a survivor behind): drop what belongs to that worker alone, such as a
        residual of unsent error feedback. Nothing, for algorithms that keep none."""

    def sync_period(self) -> int:
        """Steps between the points where every replica has synchronised all it will (a joiner
        is admitted at one of them): every step for per-step methods. A method returning H > 1
        issues no collective between them (unless ``collective_period`` says otherwise): its
        replicas run free, and survivors of a fault go on each from its own step
        (``ft/elastic.py``)."""
        return 1

    def collective_period(self) -> int:
        """Steps between the points where the algorithm may issue a collective, for the
        regroup's agreement (``ft/elastic.py``): the sync period, or a divisor of it where the
        algorithm also communicates between its syncs (``--site-H``)."""
        return self.sync_period()

    def default_snapshot_every(self) -> int:
        """Steps between snapshots unless the user says: per-step methods every 50 steps."""
        return 50

    @staticmethod
    def snapshot_boundary(period: int) -> int:
        """The first multiple of ``period`` (a sync boundary, where the replicas share the most)
        at least ``MIN_SNAPSHOT_EVERY`` steps on."""
        return period * math.ceil(MIN_SNAPSHOT_EVERY / period)

    # An adopter (a joiner, a survivor behind) rebuilds its trainable parameters from the
    # algorithm's state in ``adopted_state``, so a hand-over need not carry them (ft/handover.py).
    parameters_from_state = False

    def shared_state(self) -> list[torch.Tensor] | None:
        """What every worker holds bitwise equal at a sync boundary (where a joiner is admitted):
        the parameters, or where replicas differ between syncs the reference they share
        (SparseLoCo's and CO2's anchor, Streaming DiLoCo's global fragments); None where nothing
        is (DreamDDP averages each layer at its own iteration). An admission records its digest
        on every member, for audit (``geotrain soak``)."""
        return [p.detach() for p in self.parameters()]

    def replicated_parts(self) -> set[str]:
        """The parts of a worker's state (``geotrain.ft.state.PARTS``) that are bitwise equal on
        every worker now, after ``after_step``: a snapshot protects only the rest on peers."""
        return {"sync"}

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": self.config.as_dict(),
            "step": self.step_count,
            "syncs": self.syncs,
            **({"codec": self.codec.state_dict()} if self.codec else {}),
            # --lr-scale auto: the measured noise, equal on every worker; and this worker's own
            # sample of its gradient, held from a period's first step to its sync ("own": a
            # snapshot keeps it with the codec's residuals, never handed to another worker)
            **({"noise": self.noise.state_dict()} if self.noise else {}),
            **({"own": {"noise_sample": self.noise.pending}} if self.noise else {}),
        }

    @property
    def device(self) -> torch.device:
        """The model's device (its first parameter's), where restored state goes back to:
        snapshots and checkpoints hold it on the CPU."""
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint is for {state.get('name')!r}, not {self.name!r}")
        self.step_count = int(state["step"])
        self.syncs = int(state["syncs"])
        if self.codec and "codec" in state:
            self.codec.load_state_dict(state["codec"], self.device)
        elif self.codec and "codec_shared" in state:  # handed over: the members' (``ft.state``)
            self.codec.load_shared_state_dict(state["codec_shared"], self.device)
        if self.noise is not None:
            if "noise" in state:
                self.noise.load_state_dict(state["noise"])
            # A state handed over by another worker has none: its sample is not this worker's.
            self.noise.pending = state.get("own", {}).get("noise_sample")


class PeriodicSync(SyncAlgorithm):
    """A method that synchronises every ``config.H`` steps and issues no collective between
    (``localsgd``, ``diloco``, ``sparseloco``), but the site averages of ``--site-H``
    (``collective_period``): subclasses say what ``synchronize`` does.

    A warm start (post-local SGD, Lin et al. 2020; where the config has ``warm_start`` W > 0):
    the first W steps are synchronous SGD, the gradients averaged before each optimizer step, so
    the replicas stay equal (parameters and optimizer state) through the steep start of training
    where local steps drift most. Then the method runs periodically, its syncs at the same
    multiples of H as without a warm start.

    Where the config has ``pace`` = "time" (``sync.pace``), a period lasts the fastest worker's
    H steps: slower workers skip their last steps of it, and ``synchronize`` weighs each
    worker's contribution by ``sync_weight()``."""

    local_steps = True
    measures_noise = True

    def steps_locally(self) -> bool:
        return super().steps_locally() and not self.in_warm_start()

    def __init__(self, model, optimizer, comm, config) -> None:
        super().__init__(model, optimizer, comm, config)
        paced = getattr(config, "pace", "steps") == "time"
        site_H = getattr(config, "site_H", 0)
        require(
            not (paced and comm.checking),
            "--pace time weighs each worker's contribution by the steps it computed, which the norm "
            "check and the robust averages would judge as they are: drop --pace time, or "
            "--max-norm-ratio and --aggregate",
        )
        require(
            not site_H or comm.site_of_host is not None,
            "--site-H averages inside sites, and this run has none: give them with --hierarchy sites "
            "(--topology or --sites) or --hierarchy auto (geotrain.wrap takes no sites yet)",
        )
        if site_H and comm.two_level is None and comm.world_size > 1:
            self.notice(
                f"--site-H averages nothing here: the sites {comm.site_of_host} make one "
                "level (a single site, or sites of one host each)",
            )
        # --H-schedule (checked by the config): the period in force at each step (H without it)
        schedule = getattr(config, "H_schedule", "")
        self.periods = periods_for(schedule, config.H, getattr(config, "warm_start", 0))
        self.pacer = TimePace(config.H, comm) if paced else None
        self.last_sync = 0  # the step whose sync last completed here (step 0: the common start)

    def synchronize(self) -> None:
        """Average the replicas (each worker's contribution times ``sync_weight()``)."""
        raise NotImplementedError

    def sync_weight(self) -> float:
        """This worker's factor in the sync under way: 1, or N k_r / sum k under ``--pace time``
        (exactly 1.0 where every worker computed as many of the period's steps)."""
        if self.pacer is None or self.in_warm_start():
            return 1.0
        steps = self.step_count % self.config.H or self.config.H
        levels = self.comm.two_level if self.site_H else None
        if levels is None:  # no site averages in the period
            return self.pacer.weight(steps)
        return self.pacer.weight(steps, self._last_site_index(steps), levels.site_of_rank)

    def _last_site_index(self, index: int) -> int:
        """The period index of the last site average before ``index`` (``--site-H``; 0: none in
        this period yet). Sites average at the multiples of site_H that are not boundaries."""
        start = self.step_count - index  # the period's first step, counted from 0
        last = (self.step_count - 1) // self.site_H * self.site_H
        return last - start if last > start else 0

    def _paced_sync(self) -> None:
        # First: a failure here has changed nothing. Redone after a regroup too, on every member
        # alike (one that meets the boundary from its own step exchanges there): a worker whose
        # sample already went adds zeros that weigh nothing.
        if self.noise is not None:
            self.noise.exchange(self.comm)
        if self.pacer is None:
            self.synchronize()
        else:
            following = self.pacer.exchange()  # first: a failure here has changed nothing
            self.synchronize()
            self.pacer.quotas = following
        self.last_sync = self.step_count

    def synced_now(self) -> bool:
        """Whether the parameters are the replicas' last average right now: in the warm start,
        or after this step's sync completed. Not at a boundary whose sync failed (a survivor that
        adopts this worker's state then must not take its parameters for the average)."""
        return self.step_count <= self.warm_start or self.last_sync == self.step_count

    def _paced_index(self) -> int | None:
        """The step under way's place in its period where ``--pace time`` decides who computes
        it; None where every worker does (unpaced, or in the warm start)."""
        if self.pacer is None or self.in_warm_start():
            return None
        return self.step_count % self.config.H

    def computes_step(self) -> bool:
        index = self._paced_index()
        return True if index is None else self.pacer.computes(index)

    def workers_computing(self) -> int:
        index = self._paced_index()
        return self.comm.world_size if index is None else self.pacer.workers_computing(index)

    def rebind(self) -> None:
        if self.pacer is not None:
            self.pacer.reset()  # the new group's first period runs unpaced, its sync unweighted

    def defers_admission(self) -> bool:
        # Not in the warm start (a collective every step), nor with --site-H's site averages
        # between syncs, --pace time's weights or --lr-scale auto's agreement at a regroup.
        return (
            not self.in_warm_start()
            and self.sync_period() > 1
            and self.collective_period() == self.sync_period()
            and self.pacer is None
            and self.noise is None
        )

    @property
    def warm_start(self) -> int:
        return getattr(self.config, "warm_start", 0)

    def in_warm_start(self) -> bool:
        """The step under way (not yet counted) is one of the first ``warm_start``."""
        return self.step_count < self.warm_start

    def at_boundary(self) -> bool:
        return self.step_count <= self.warm_start or self.periods.is_boundary(self.step_count)

    def before_step(self) -> None:
        # From the replicas' common parameters: after a sync, or the warm start's last step (not
        # at each warm step: only the last sample before the first periodic sync is exchanged).
        if self.noise is not None and self.step_count >= self.warm_start and self.at_boundary():
            self.noise.record()
        if self.in_warm_start():
            for p in self.parameters():
                if p.grad is None:  # unused in this step's graph: contributes zero, as in DDP
                    p.grad = torch.zeros_like(p)  # (and every worker's buckets stay the same)
            reduce_tensors(self.comm, [p.grad for p in self.parameters()], self.config.bucket_mb)

    def after_step(self) -> bool:
        warm = self.in_warm_start()
        if self.pacer is not None:
            self.pacer.stepped()
        super().after_step()
        if warm:  # the replicas are equal already
            self.syncs += 1
            if self.step_count == self.warm_start:  # what stands for the last average: this
                self.track_parameters()
            return True
        if self.at_boundary():
            self._paced_sync()
            return True
        if self._site_step():
            self.average_in_site(self._site_weight())
        return False

    def _site_weight(self) -> float:
        """``--pace time``: this worker's factor in the site average just due, token-weighted
        over the steps each of its site computed since the last (``TimePace.site_weight``)."""
        levels = self.comm.two_level
        index = self._paced_index()
        if index is None or levels is None:
            return 1.0
        return self.pacer.site_weight(self._last_site_index(index), index, levels.site_of_rank)

    @property
    def site_H(self) -> int:
        return getattr(self.config, "site_H", 0)

    def _site_step(self) -> bool:
        """The step just counted averages inside the sites (``--site-H``; not a sync across)."""
        return bool(self.site_H) and self.step_count % self.site_H == 0 and not self.at_boundary()

    def average_in_site(self, weight: float = 1.0) -> None:
        """``--site-H``: the parameters averaged over this worker's site (its LAN), between the
        syncs across sites. Inside a site the replicas then drift for site_H steps only; across
        sites for H. The optimizers' states stay each worker's own, as between any syncs.
        ``weight``: this worker's factor (``--pace time``'s token weight)."""
        params = [p.data for p in self.parameters()]
        flat = flatten(params)
        if weight != 1.0:
            flat.mul_(weight)
        self.comm.site_mean(flat)
        unflatten_into(flat, params)

    def track_parameters(self) -> None:
        """The warm start's last step: any reference copy of the last average (DiLoCo's
        theta_outer) becomes the parameters, which are the average. (Until then a snapshot or a
        hand-over takes it from the parameters: every warm step is a sync boundary.)"""

    def finalize(self) -> None:
        if not self.at_boundary():
            self.synchronize()

    def retry_sync(self, adopters: Collection[int] = ()) -> None:
        if self.step_count <= self.warm_start:
            return
        # A failed synchronisation changed nothing it would redo twice. The adopters' copies of
        # the leader's contributions are left out of its averages (``leaving_out``: the site's
        # too), and the methods with a message of their own send an empty one (``contributes``).
        with self.comm.leaving_out(adopters):
            if self.at_boundary():
                self._paced_sync()
            elif self._site_step():  # on the new group's sites (its first period runs unpaced)
                self.average_in_site()

    def collective_period(self) -> int:
        # --site-H: the site averages are collectives too, so survivors that differ in how many
        # they have done are not free to go on each from its own step.
        period = self.sync_period()
        return math.gcd(period, self.site_H) if self.site_H and period > 1 else period

    def sync_period(self) -> int:
        # In the warm start every step is a collective: the membership layer must treat the
        # members as lock-stepped (a survivor a step behind adopts the leader's state).
        return 1 if self.in_warm_start() else self.periods.period(self.step_count)

    def default_snapshot_every(self) -> int:
        # A sync boundary, where the replicas share the most (under --H-schedule one that ends a
        # period of every stage, where that is not far apart), at least MIN_SNAPSHOT_EVERY steps on.
        common = self.periods.common_multiple()
        return self.snapshot_boundary(common if common <= 4 * self.config.H else self.config.H)

    def replicated_parts(self) -> set[str]:
        if self.step_count <= self.warm_start and self.comm.world_size > 1:
            return {"model", "optimizer", "sync"}  # synchronous SGD so far: all equal
        # Right after a sync the parameters are equal; the (inner) optimizers never are.
        return {"model", "sync"} if self.at_boundary() else {"sync"}

    def info(self) -> str:
        if self.periods.grows:
            return "; ".join(filter(None, [super().info(), f"period {self.periods.describe()}"]))
        if self.pacer is None:
            return super().info()
        paced = f"paced by time: steps computed per period of {self.config.H}, by rank: {self.pacer.quotas}"
        return "; ".join(filter(None, [super().info(), paced]))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.pacer is not None:
            state["pace"] = self.pacer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.pacer is not None and "pace" in state:
            self.pacer.load_state_dict(state["pace"])
        # A snapshot is taken after a completed step; a hand-over's leader may have failed its
        # sync (DiLoCo then sends theta_outer, and says so).
        self.last_sync = self.step_count if self.at_boundary() else -1


class InFlight:
    """This worker's message whose collective lands later (SparseLoCo's outer step tau steps or a
    period late, DeMo's step one step late, CO2's average tau steps into the next period, a
    Streaming DiLoCo fragment tau steps late), under compute, and what a regroup, a snapshot and an
    adoption do with it. ``op`` is the collective: ``"gather"`` (every worker's message, stacked in
    rank order) or ``"mean"`` (their mean, an all-reduce of the message with a weight of 1 appended,
    so that the mean is over the workers that sent one: an adopter's empty message weighs 0). Every
    member must make the same collectives in the same order, so:

    - a regroup (``rebind``) sends the message again on the new group at the next ``land``;
    - a snapshot holds this worker's own message (``saved``), and a resumed worker sends it
      again first (``restore``), so N + stop + N lands the same bytes as 2N;
    - a worker that adopted another's state (a joiner, a survivor behind) takes part in the
      members' collective in flight with an empty message of the same size (``adopted``): the
      message it loaded is the other worker's, and would count twice. An empty message weighs
      nothing: the mean's weight is 0, and the gathers' decoders (``ChunkTopK.mean_of``,
      Streaming DiLoCo's ``_mean``) leave all-zero payloads out of their mean."""

    def __init__(self, comm, op: str = "gather", keeps_landed: bool = False) -> None:
        if op not in ("gather", "mean"):
            raise ValueError(f"op must be 'gather' or 'mean', got {op!r}")
        self.comm = comm
        self.op = op
        # keep ``last_landed`` (SparseLoCo's: a few KB of payloads; CO2's: its N 4-bit messages,
        # or with fp32 a model's worth)
        self.keeps_landed = keeps_landed
        # (rank, group size) it last sent as: the rows of its collective are in that group's order
        self.sent_as: tuple[int, int] | None = None
        # The hosts of that group by rank (None where not known), and of the collective last
        # landed (``landed_hosts``): whose rows its result holds, which the norm check reads
        # (``rows_judged``) where they are another group's (kept at a regroup, or sent by
        # another survivor).
        self.sent_hosts: tuple[int, ...] | None = None
        self.landed_hosts: tuple[int, ...] | None = None
        self._primed_hosts: tuple[int, ...] | None = None
        self._handle = None
        self._payload: torch.Tensor | None = None  # of the collective in flight, as sent
        self._resend: torch.Tensor | None = None  # to send again at the next land
        # The collective's result, where it completed on another survivor and not here (a
        # regroup's ``prime``): the next land returns it, sending nothing.
        self._primed: torch.Tensor | None = None
        self._arrived = None  # the collective whose own result is primed (``keep_arrived``)
        # The last landed collective's result as it came (a mean's weight last), until the next
        # landing (past the next launch: a survivor a period behind may lack it): what a
        # survivor whose wait failed is sent instead of a whole state.
        self.last_landed: torch.Tensor | None = None
        self.last_landed_size: int | None = None
        self.landings = 0  # messages landed so far
        self.stand_in = False  # the collective in flight was put back by ``take_live``

    @property
    def flying(self) -> bool:
        return self._handle is not None or self._resend is not None or self._primed is not None

    @property
    def resending(self) -> bool:
        """The next ``land`` sends the message again (after a regroup or a resume) first."""
        return self._resend is not None

    def arrived(self) -> bool:
        """The collective in flight has completed: ``land`` would not wait (False if none flies
        or it is still to be sent again)."""
        return self._handle is not None and self._handle.is_completed()

    def _group_hosts(self) -> tuple[int, ...] | None:
        hosts = getattr(self.comm, "group_hosts", None)  # (a test's stand-in communicator: none)
        return hosts() if hosts is not None else None

    def launch(self, payload: torch.Tensor) -> None:
        self.stand_in = False
        self.sent_as, self.sent_hosts = (self.comm.rank, self.comm.world_size), self._group_hosts()
        if self.op == "gather":
            self._handle, self._payload = self.comm.all_gather(payload, async_op=True), payload
        else:  # the all-reduce works in place: keep the message as sent, to send it again
            self.launch_weighted(torch.cat([payload.reshape(-1), payload.new_ones(1)]))

    def launch_weighted(self, message: torch.Tensor) -> None:
        """A ``mean`` message as ``saved`` holds it (its weight last): sent again as it was. A
        message left out by ``--max-norm-ratio`` is zeroed with its weight, so it weighs 0. The
        screen before it is a collective: if it fails, nothing is in flight (the caller's retry,
        ``retry_sync``, makes the message again: had it been kept to send again, the retry's
        landing would take it for the last one's and apply it twice)."""
        self._payload, self.stand_in = message, False
        self.sent_as, self.sent_hosts = (self.comm.rank, self.comm.world_size), self._group_hosts()
        try:
            self._handle = self.comm.all_reduce(message.clone(), op="sum", async_op=True, screen=True)
        except RuntimeError:
            self._payload = None
            raise

    def launch_empty(self, shape: list[int], dtype: str, device: torch.device) -> None:
        """An empty message of ``shape`` and ``dtype`` (the members' in flight): a joiner's part
        of their collective, which weighs nothing (all zero bytes; a mean's weight 0)."""
        empty = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        (self.launch if self.op == "gather" else self.launch_weighted)(empty)

    def land(self) -> torch.Tensor | None:
        """Every worker's message stacked in rank order (``gather``) or their mean (``mean``),
        once it has arrived; None if none flies. If the wait fails (a lost member), the message
        stays in flight for ``rebind``."""
        if self._primed is not None:  # completed elsewhere (or here, on a group left): its result
            landed, self._primed, self._payload, self._arrived = self._primed, None, None, None
            self.landed_hosts = self._primed_hosts
            return self._finish(landed)
        if self._resend is not None:
            resend, self._resend = self._resend, None
            try:
                (self.launch if self.op == "gather" else self.launch_weighted)(resend)
            except RuntimeError:  # (a mean's screen) still the message to land: sent again later
                self._resend = resend
                raise
        if self._handle is None:
            return None
        landed = self._handle.wait()
        self._handle = self._payload = None
        self.landed_hosts = self.sent_hosts
        return self._finish(landed)

    def _finish(self, landed: torch.Tensor) -> torch.Tensor:
        self.last_landed = landed if self.keeps_landed else None
        # the size of the group it ran in (this worker's message was in it), kept with it: by
        # a later launch on a group formed since, ``sent_as`` names that one
        self.last_landed_size = self.sent_as[1] if self.sent_as is not None else None
        self.landings += 1
        if self.op == "mean":  # the sum over the senders, divided by how many sent
            landed = landed[:-1] / landed[-1] if landed[-1] > 0 else torch.zeros_like(landed[:-1])
        return landed

    def prime(self, result: torch.Tensor, hosts: tuple[int, ...] | None = None) -> None:
        """The collective in flight completed on another survivor (its ``last_landed``) while
        this one's wait failed: the next ``land`` returns ``result`` as if it had completed
        here, and sends nothing (``ft/elastic.py``, which lands it in the same regroup's
        redone sync). This worker's own message was in it. ``hosts``: of the group it ran in
        (by default the one this worker sent it in)."""
        if self._resend is not None:  # its own message, for ``unprime``
            self._payload = self._resend
        self._primed, self._handle, self._resend = result, None, None
        self._primed_hosts = tuple(hosts) if hosts is not None else self.sent_hosts

    @property
    def primed(self) -> bool:
        return self._primed is not None

    @property
    def primed_hosts(self) -> tuple[int, ...] | None:
        """The hosts, by rank, of the group whose collective gave ``primed_result``."""
        return self._primed_hosts if self._primed is not None else None

    def rows_judged(self):
        """A context in which the norm check (``Communicator.judging_rows_of``) reads the rows of
        the result just landed as the ranks of the group it ran in, where that is not the group
        this worker is in now: a result kept at a regroup, or landed by another survivor and
        sent here. Every worker that lands it then judges it as those of the old group did,
        and counts a rejection against the host that sent the row. Its verdicts are a landing's
        (``judging_a_landing``): a regroup keeps them, where it forgets the rest of a step cut
        short."""
        hosts, judging = self.landed_hosts, getattr(self.comm, "judging_rows_of", None)
        landing = getattr(self.comm, "judging_a_landing", None)  # (kept through a regroup)
        stack = contextlib.ExitStack()
        if landing is not None:
            stack.enter_context(landing())
        if hosts is not None and judging is not None and hosts != self._group_hosts():
            stack.enter_context(judging(hosts))
        return stack

    @property
    def primed_result(self) -> torch.Tensor | None:
        """The result ``land`` returns next, nothing sent (``prime``): what a worker restored
        from this one's state (a joiner, a snapshot's resume) must land the same way."""
        return self._primed

    def unprime(self) -> None:
        """A regroup begins with a result primed and not landed (the one that primed it failed
        again): it is dropped and this worker's own message is in flight again, to send at the
        next ``land`` (the new regroup decides afresh what each survivor lacks); where the
        result was its own collective's (``keep_arrived``), that collective is in flight again."""
        if self._primed is not None and self._arrived is not None:
            self._primed, self._handle, self._arrived = None, self._arrived, None
        elif self._primed is not None:
            self._primed, self._resend = None, self._payload

    def live(self) -> tuple | None:
        """The collective in flight, where this worker has launched it in the current group (its
        handle, this worker's message and the rank it sent it as): kept across a load of another
        worker's state, which would replace it with a message to send again (``take_live``)."""
        return (
            (self._handle, self._payload, self.sent_as, self.sent_hosts) if self._handle is not None else None
        )

    def take_live(self, live: tuple | None) -> None:
        """``live`` (from ``live``) is in flight again: the next ``land`` waits for it, nothing
        sent again. A joiner that stood in for a redone sync took part in that sync's collective
        with an empty message; the state it loads after holds the leader's message to send, and
        sending it would pair with the members' next collective."""
        if live is not None:
            self._handle, self._payload, self.sent_as, self.sent_hosts = live
            self._resend = self._primed = self._arrived = None
            self.stand_in = True  # (its wait says nothing of the link: an empty message, sent early)

    @property
    def untimed(self) -> bool:
        """Its collective in flight is a stand-in's (``take_live``), launched before this worker
        held the state, not at its own outer step: how long its landing waited is no measure of
        the link (SparseLoCo's ``--overlap auto`` landing), as a message sent again is not."""
        return self._handle is not None and self.stand_in

    def arrived_intact(self) -> bool:
        """Its collective completed here without error (on a group a regroup has since left):
        its result can land with nothing sent again (``keep_arrived``)."""
        if self._handle is None or not self._handle.is_completed():
            return False
        try:
            self._handle.wait()  # (completed: returns at once, its result or its error)
        except Exception:  # (a timeout is named as ``CollectiveTimeout``)
            return False
        return True

    def keep_arrived(self) -> None:
        """A regroup agreed that every member holding this message has its collective's result
        (``arrived_intact``): the next ``land`` returns it, nothing sent again, as where another
        survivor sent it (``prime``)."""
        handle = self._handle
        self.prime(handle.wait())
        self._arrived = handle  # for ``unprime``

    def close(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None

    def rebind(self) -> None:
        if self._handle is not None:
            self._resend, self._handle = self._payload, None

    def adopted(self) -> None:
        if self._resend is not None:  # all zeros decode to nothing (and weigh 0 in a mean)
            self._resend = torch.zeros_like(self._resend)
        if self._primed is not None and self._payload is not None:  # (the other's, kept to resend)
            self._payload = torch.zeros_like(self._payload)

    def saved(self) -> torch.Tensor | None:
        return self._resend if self._resend is not None else self._payload

    def own_row(self, rows: int) -> int | None:
        """This worker's row in the last landed collective's ``rows`` (its rank in the group it
        sent it in), None where it sent none there: a result kept from an older group, or handed
        over with the state (``prime``), was sent in that group, its rows in that group's order."""
        if self.sent_as is None or self.sent_as[1] != rows:
            return None
        return self.sent_as[0]

    def restore(
        self,
        payload: torch.Tensor | None,
        device: torch.device | None = None,
        result: torch.Tensor | None = None,
        hosts: tuple[int, ...] | list[int] | None = None,
    ) -> None:
        """Resend ``payload`` (a saved ``saved()``), moved to ``device`` (a snapshot's is on the CPU).
        Sent in no group yet: ``sent_as`` is that of its next launch. ``result``: its collective's,
        kept at a regroup (``primed_result``, saved beside it): landed from it, nothing sent.
        ``hosts``: of the group that collective ran in (``primed_hosts``, saved beside it)."""
        self._handle = self._payload = self._primed = self.last_landed = self._arrived = None
        self.sent_as = self.sent_hosts = None
        self._resend = payload.to(device) if payload is not None and device is not None else payload
        if payload is not None and result is not None:
            self.prime(result.to(device) if device is not None else result, hosts)
