"""``dreamddp``: partial local SGD with layer-wise averaging overlapped with backprop.

DreamDDP (Tang et al., arXiv 2502.11058). Local SGD averages the whole model every H steps and
stalls on that all-reduce. DreamDDP spreads it over the period: iteration h in [0, H) averages
only the layers S_h of a schedule in which every layer appears once per period (plus fill-ins,
layers that fit in the bubbles). A scheduled layer's parameter all-reduce is launched from its
gradient hook, the moment backward has accumulated that layer's gradient (its parameters are not
read again in this backward), so it runs under the remaining backward. All handles are waited
for after backward; the averaged values are written back and only then is the local optimizer
step applied:

    x_l <- mean_k(x_l^k) - lr * g_l^k      for l in S_h,      x_l <- x_l - lr * g_l otherwise.

No second copy of the model is kept: only the layers in flight are flattened into send buffers.
With ``compress``, a layer's change since its last average is sent (as ``localsgd`` does), which
needs one copy of the model: x_l <- x_ref_l + mean_k(x_l^k - x_ref_l) - lr * g_l^k.

``lag`` 1 (the default; beyond the paper): an iteration's averages land when each layer's next
forward begins (a forward pre-hook on its module), not at the end of backward, so a layer's
all-reduce runs under the rest of backward, the update and the forward of the layers before it:

    x_l <- x_l + (mean_k(x_l^k) - x_l^k)     at layer l's next forward (after the update -lr g_l^k)

which is the same point as lag 0's mean - lr g_l^k: the next gradient is taken where lag 0 takes
it (measured on GPT ``tiny``, 4 workers, 200 steps: 2.282 against 2.284 at lag 0; landing at the
next iteration's end of backward instead, its gradient taken before the average, gave 2.419).
The period's last iteration lands its own at once, so a period ends with nothing in flight
(snapshots, re-plans and regroups happen there); a snapshot inside a period lands what flies
first (the same values: no update comes between). The schedule is searched for these deadlines
(``plan.cost.deadlines``). Measured on W1 at 100 Mbit/s (GPT ``mini``, 4 workers): 1.86-1.90 s a
step against 1.98 s at lag 0 (nosync 1.72-1.74 s). With a codec a run lands at once by default
(``plan.cost.default_lag``: lag 1 measured slower on CPU workers), and each layer's second phase
(the quantisers' all-gather, PowerSGD's Q) goes out under backward, a few layers after its first
(``_advance_launched``), so the update waits only for the last few; at ``lag`` 1 what lands late
is the mean change (x_l <- x_l + mean change - change sent), its first collective runs under
backward, and its second (the quantisers' all-gather of the averaged shards) is launched in
``before_step`` and runs under the update and the forward (``plan.cost.exposed_for_layers``).

``compress="auto"`` (beyond the paper): the planner chooses the codec with the period, among
uncompressed, the quantisers and the chunked top-k (``plan.schedule.AUTO_CODECS``), by predicted
time to a loss:
each codec's messages and its encoding (timed by the profile) priced, at the lag a run with it
lands at; a codec must come out ``CODEC_MARGIN`` sooner than fp32. Chosen once, at the first
plan, like ``H="auto"``; re-plans and a resumed run keep it (the plan records it).

The schedule comes from ``geotrain plan`` (``plan_path``) or is made at start-up from a quick
profile (``prepare``). Beyond the paper: at each period boundary the measured iteration time is
compared with the plan's prediction, and if they differ by more than ``replan_threshold`` (the link
got slower, a worker got busier) in two periods running, the workers profile again and re-plan.
And once, a few periods into the run, the link's slowdown under backward (sigma, which a
profile's contention probe reads with plain all-reduces) is fitted to the time each step of the
period spent blocked (``fit_comm_slowdown``), and where it differs the schedule is searched
again with it: on W1 a plan made at sigma 1 put 36 of 40 layers in one iteration of two, whose
step measured 0.37 s blocked where the model priced 0.09 s of exposure, and alternating layers
measured faster (2.23 s against 2.35 s a step).

The planning (profiling, pricing each codec, choosing the period and the codec, the search, the
re-plans and the slowdown's fit) is in ``sync.dreamddp_plan``; this module carries a plan out.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch

from geotrain.comm.buckets import (
    advance_behind,
    flat_copy,
    flatten,
    reduce_tensors,
    unflatten_into,
    wait_all,
)
from geotrain.compress.codec import Codec, ConfigError
from geotrain.plan.cost import (
    ADVANCE_DEPTH,
    ComputeModel,
    LinkModel,
    default_lag,
    predict_schedule,
    unpriced,
)
from geotrain.plan.layers import layer_groups, order_layers
from geotrain.plan.profile import StepObserver, profile_for_workers
from geotrain.plan.schedule import (
    AUTO_CODEC,
    Schedule,
    schedule_from_json,
)
from geotrain.sync.base import SyncAlgorithm, SyncConfig, adopt_mean_change, codec_from_config, require
from geotrain.sync.dreamddp_plan import DreamDDPPlanning


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """A ComputeModel's fields read back from JSON: its lists as the tuples it holds."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


class _ModuleHook:
    """A forward pre-hook that acts on this model only: a deep copy of the model (an EMA, an
    evaluation copy) gets an inert hook, not a copy of the algorithm and its collectives."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, module, args) -> None:
        self.fn(module, args)

    def __deepcopy__(self, memo) -> Callable[..., None]:
        return _inert


def _inert(module, args) -> None:
    return None


REPLAN_AFTER_PERIODS = 2  # periods in a row that must drift before a re-plan
OBSERVED_STEPS = 3  # steps timed for the plan when no loss function is given (after a warm-up)


@dataclass
class DreamDDPConfig(SyncConfig):
    # Its local AdamW steps at 1x, as the base's: --lr-scale auto (sync/noise.py) was its default
    # for one stop, and on W1 over 2,000 steps at H=10 it needed ~1.28x DDP's tokens for DDP's
    # loss where 1x needed 1.17x (one seed each; its measure counts the layers' staggered
    # averaging as noise and runs near sqrt(N), 1.97 at the end). With int4 at H=2 it needed
    # 0.96x, and 0.99x at 1x (docs/reaching-ddp-loss.md): the period, not the rate, closes the gap.
    #
    # H=2 with the codec chosen (int4 on W1 at 100 Mbit/s) by default since: on W1 it reaches
    # DDP's loss at 2,000 steps in 0.99x DDP's tokens where H=10 uncompressed needed 1.17x, and
    # int4 at H=2 sends 4.2 MB a step where fp32 at H=10 sends 6.5 (docs/reaching-ddp-loss.md).

    H: int | str = 2  # "auto": the period with the shortest predicted time to a loss (choose_period)
    plan_path: str = ""  # a plan from `geotrain plan`; "": profile and plan at start-up
    fill_in: bool = False  # measured: no loss gained, 5-10% of the step lost on W1 (see the docstring)
    # 1: a layer's average lands at its next forward; 0: before the update; None: 1, or 0 with a
    # codec (``plan.cost.default_lag``, measured)
    lag: int | None = None
    replan_threshold: float = 0.25  # relative drift of measured from predicted time; 0: never re-plan
    # a codec spec (geotrain.compress); "auto": the planner's (choose_codec); "" or "none": fp32
    compress: str = "auto"

    def __post_init__(self) -> None:
        require(
            self.H == "auto" or (isinstance(self.H, int) and self.H >= 1),
            f"H (the schedule's period in iterations) must be an integer >= 1 or 'auto', got {self.H!r}",
        )
        require(
            self.lag in (None, 0, 1),
            f"lag (iterations before a layer's average lands) must be 0 or 1, got {self.lag}",
        )
        require(
            self.replan_threshold >= 0,
            f"replan_threshold must be >= 0 (0 = off), got {self.replan_threshold}",
        )
        if self.plan_path:
            require(
                Path(self.plan_path).is_file(),
                f"plan {self.plan_path!r} does not exist; make one with "
                "`geotrain plan --profile PROFILE --out PLAN`",
            )


class DreamDDP(DreamDDPPlanning, SyncAlgorithm):
    local_steps = True  # each layer is averaged once per period; the optimizers are each worker's
    # --lr-scale auto: measured from a period's first step, where each layer was averaged within
    # the last period (not all at once: the measure includes their small drift since), at its end
    measures_noise = True
    chooses_codec = True  # --compress auto: chosen with the schedule (choose_codec)
    name = "dreamddp"

    def __init__(self, model, optimizer, comm, config: DreamDDPConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or DreamDDPConfig())
        self.layers = layer_groups(model)
        self._ref: dict[str, list[torch.Tensor]] = {}
        self._use_codec(self.codec)
        self.schedule: Schedule | None = None
        self.predicted_step_s: float | None = None
        self.replans = 0
        self.period_choice: list[dict] | None = None  # H="auto": the periods weighed (choose_period)
        self.codec_choice: list[dict] | None = None  # compress="auto": the codecs weighed (choose_codec)
        self.reprofiles = 0  # re-plans that profiled again (a new group, or a drift no refit explains)
        self._models: tuple[ComputeModel, LinkModel] | None = None  # what the plan was searched on
        self._drifted = 0  # consecutive periods off the prediction by more than replan_threshold
        # the link's slowdown under backward fitted to the run's steps (once; None: not yet)
        self.fitted_slowdown: float | None = None
        self._blocked: list[list[float]] = []  # per iteration of the period: seconds blocked
        self._blocked_mark = 0.0
        self._periods_planned = 0  # periods run on the current plan, before the slowdown's fit
        self._owner = {id(p): i for i, layer in enumerate(self.layers) for p in layer.params}
        self._active: set[int] = set()
        self._ready = [0] * len(self.layers)
        self._inflight: dict[int, Any] = {}
        # lag 1: the averages launched last iteration, landing in this one's before_step, each
        # with what this worker sent (the mean's change from it is what lands)
        self._late: dict[int, tuple[Any, torch.Tensor]] = {}
        self._sent: dict[int, torch.Tensor] = {}  # this iteration's messages as sent, where late
        self._profiling = False
        self._profile_fn: Callable[[], torch.Tensor] | None = None
        self._observer: StepObserver | None = None  # timing the first steps (observe())
        self._observe_left = 0
        # Iteration time runs from forward to the end of the step: evaluation or logging between
        # steps is not drift.
        self._iteration_start = 0.0
        self._period_s = 0.0
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for layer in self.layers
            for p in layer.params
        ]
        self._hooks.append(model.register_forward_pre_hook(_ModuleHook(self._on_forward)))
        # lag 1: a layer's average lands when its module's next forward begins
        for layer in self.layers:
            module = model if layer.name == "<root>" else model.get_submodule(layer.name)
            self._hooks.append(module.register_forward_pre_hook(_ModuleHook(self._lander(layer.params[0]))))
        if self.config.plan_path:
            try:
                self.set_plan(json.loads(Path(self.config.plan_path).read_text()))
            except ConfigError:
                raise
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(
                    f"plan {self.config.plan_path!r} does not fit this model ({type(e).__name__}: {e}); "
                    "make one with `geotrain plan` for it"
                ) from None

    @property
    def lag(self) -> int:
        """The lag this run lands at: ``config.lag``, by default 1, or 0 with a codec
        (``plan.cost.default_lag``: measured slower at lag 1 on CPU workers). With a codec at
        lag 1 an iteration landing late issues its second phases in ``before_step`` (at once,
        they go out under backward: ``_advance_launched``): each average is advanced
        there (its first phase waited for, its second, the quantisers' all-gather or PowerSGD's
        Q, launched: ``Pending``), in forward order, and only waited for at its layer's next
        forward, so the second phases run under the update and the forward instead of before
        them. But a checked codec (``--max-norm-ratio``, ``--aggregate``; off for dreamddp by
        default) lands at once: its second phase's verdicts count towards the step that sent
        them, as the membership layer reads them (``--max-rejections``)."""
        return self._lag_with(self.codec)

    def _lag_with(self, codec: Codec | None) -> int:
        if codec is not None and self.comm.checking:
            return 0
        return default_lag(codec is not None) if self.config.lag is None else self.config.lag

    # -- planning -----------------------------------------------------------------------------
    def set_plan(self, plan: dict[str, Any]) -> None:
        """Adopt a plan (``geotrain plan`` output): the backward order of layers and the schedule."""
        schedule, names = schedule_from_json(plan["schedule"])
        if self.config.compress == AUTO_CODEC:
            self._adopt_codec(plan)
        if self._observer is not None:  # a plan came (a restored state): no steps to time
            self._observer.close()
            self._observer = None
        self.layers = order_layers(self.layers, names)
        self._owner = {id(p): i for i, layer in enumerate(self.layers) for p in layer.params}
        self._ready = [0] * len(self.layers)
        self.schedule = schedule
        self._blocked, self._periods_planned = [[] for _ in range(schedule.H)], 0
        self._plan = plan
        self.config.H = schedule.H
        self.period_choice = plan.get("period_choice")
        self.predicted_step_s = plan.get("predicted_s", {}).get("dreamddp")
        models = plan.get("models")
        self._models = None
        if models:
            compute, link = ComputeModel(**_tuples(models["compute"])), LinkModel(**models["link"])
            priced_for, mine = models.get("codec", ""), self._codec_key()
            if priced_for != mine and compute.raw_nbytes:  # another codec's or group's: unpriced
                self.notice(
                    f"the plan was priced for {priced_for}, this run sends "
                    f"{mine or 'fp32 all-reduces'}: its schedule is kept, its messages priced again",
                )
                compute, priced_for = unpriced(compute), ""
            if not priced_for and self.codec is not None:  # `geotrain plan`'s: plain all-reduces
                compute, priced_for = self._priced(compute, self.codec), mine
            if priced_for != models.get("codec", "") or schedule.lag != self.lag:
                self.predicted_step_s = predict_schedule(compute, link, schedule.iterations, self.lag)
            # priced for what cannot be undone (a plan older than raw sizes): a re-plan profiles again
            self._models = (compute, link) if priced_for == mine else None
        self._begin_iteration()

    def prepare(self, loss_fn: Callable[[], torch.Tensor]) -> None:
        """Profile and plan on all workers if no plan was given (called once before training)."""
        self._profile_fn = loss_fn
        if self.schedule is None:
            self._replan()

    def prepare_unprofiled(self) -> None:
        self.observe()  # plans from the first steps of the loop itself (unless a plan was given)

    def observe(self, steps: int = OBSERVED_STEPS) -> None:
        """No plan and no loss function to profile with (``geotrain.wrap`` without either): the
        first ``steps`` + 1 training steps are timed as they run (``StepObserver``), every layer
        averaged at each of them so that no replica drifts meanwhile, and the schedule is
        planned from what they measured."""
        if self.schedule is None:
            self._observer = StepObserver(self.module, self.layers)
            self._observe_left = steps + 1  # the first is a warm-up

    # -- one iteration ------------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        assert self.schedule is not None
        self._active = set(self.schedule.iterations[self.step_count % self.schedule.H])
        self._ready = [0] * len(self.layers)
        self._inflight = {}

    def _on_forward(self, module, args) -> None:
        if module.training and not self._profiling:
            self._iteration_start = time.perf_counter()
            self._blocked_mark = self.comm.stats.blocked_s

    def _lander(self, param: torch.Tensor) -> Callable[..., None]:
        def land(module, args) -> None:
            i = self._owner[id(param)]  # by a parameter of the layer: a re-plan reorders them
            if i in self._late:
                self._land_late(i)

        return land

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self._profiling or self.schedule is None:
            return
        i = self._owner[id(param)]
        if i not in self._active:
            return
        self._ready[i] += 1
        if self._ready[i] == len(self.layers[i].params):
            self._launch(i)

    def _launch(self, i: int) -> None:
        # Backward has accumulated this layer's gradient and will not read its parameters again,
        # so their current values can be sent while backward goes on.
        if i in self._late:  # its last average first: a change counted from what was sent once
            self._land_late(i)
        params = [p.detach() for p in self.layers[i].params]
        if self.codec is not None:
            if self._lands_now():
                self._advance_launched()
            name = self.layers[i].name
            deltas = [p - ref for p, ref in zip(params, self._ref[name], strict=True)]
            # the codec writes the mean change into ``deltas``; landing late needs what was sent
            sent = [d.clone() for d in deltas] if not self._lands_now() else None
            self._inflight[i] = (self.codec.reduce(self.comm, name, deltas), (deltas, sent))
            return
        lands_now = self._lands_now()
        # landing late, a copy: the update would write a view of one tensor while the mean lands
        message = flatten(params) if lands_now else flat_copy(params)
        if not lands_now:
            self._sent[i] = message.clone()
        self._inflight[i] = self.comm.all_reduce(message, op="mean", async_op=True)

    def _advance_launched(self) -> None:
        """Where a codec's averages land at once, their second phases go out under backward
        (``advance_behind``; the dict's order is the launch order). Waiting after backward for
        them all left every second phase exposed; where the link cannot keep up, backward
        waits here for what the update would have waited for (``plan.cost.codec_exposed``).
        Landing late, the second phases go out in ``before_step``, under the update and the
        forward, leaving backward's link to the first phases, whose results the update needs."""
        advance_behind(self._inflight.values(), ADVANCE_DEPTH, itemgetter(0))

    def _lands_now(self) -> bool:
        """Whether this iteration's averages land in its own before_step: always at lag 0, and
        at lag 1 in a period's last iteration, so that a period ends with nothing in flight
        (snapshots, re-plans and regroups happen at boundaries)."""
        return self.lag == 0 or self.step_count % self.schedule.H == self.schedule.H - 1

    def _land_late(self, i: int) -> None:
        """x <- x + (mean - sent): the average lands with the local steps taken since it was
        sent kept (x_sent - u + mean - x_sent = mean - u, what landing at once and then taking
        the step u gives). With a codec the same in changes from the reference: x_ref <- x_ref +
        mean change, x <- x + (mean change - change sent)."""
        handle, sent = self._late.pop(i)
        params = [p.data for p in self.layers[i].params]
        try:
            mean = handle.wait()  # a codec's: advanced in before_step, no collective issued here
        except Exception:
            # the group failed: every average in flight on it is lost with it (as in rebind), so
            # a hand-over's snapshot after this finds none to wait for
            self._late, self._sent = {}, {}
            raise
        if self.codec is not None:
            changes, sent_changes = sent
            with torch.no_grad():
                for p, ref, change, mine in zip(
                    params, self._ref[self.layers[i].name], changes, sent_changes, strict=True
                ):
                    ref.add_(change)
                    p.add_(change.sub_(mine))
            return
        with torch.no_grad():
            change = mean.sub_(sent)  # mean - sent, flat
            offset = 0
            for p in params:
                p.add_(change[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def before_step(self) -> None:
        if self.schedule is None and self._observer is not None:
            self._observer.update_starts()
            return
        if self.schedule is None:
            raise RuntimeError("dreamddp has no schedule: call prepare() or give a plan")
        if self.noise is not None and self.step_count % self.schedule.H == 0:  # a period's first
            self.noise.record()
        for i in sorted(self._active - set(self._inflight)):  # layers whose gradient never came
            self._launch(i)
        self._land_all_late()  # last iteration's that no forward landed (a module not called)
        if self.codec is not None:
            # Every collective of this iteration issued now, in one order on every worker: the
            # second phases in forward order (the first layer the next forward needs, first).
            order = sorted(self._inflight, reverse=True)
            messages = [self._inflight[i][0] for i in order]
            if not self._lands_now():  # each waited for at its layer's next forward
                for message in messages:
                    message.advance()
                self._late, self._inflight = self._inflight, {}
                return
            wait_all(messages)
            for i in order:
                layer, (deltas, _) = self.layers[i], self._inflight[i][1]
                adopt_mean_change([p.data for p in layer.params], self._ref[layer.name], deltas)
            self._inflight = {}
            return
        if not self._lands_now():  # held until the next iteration, with what was sent
            self._late = {i: (handle, self._sent[i]) for i, handle in self._inflight.items()}
            self._inflight, self._sent = {}, {}
            return
        with torch.no_grad():
            for i, handle in self._inflight.items():
                unflatten_into(handle.wait(), [p.data for p in self.layers[i].params])
        self._inflight = {}  # free the send buffers now, not at the next iteration

    def after_step(self) -> bool:
        if self.schedule is None and self._observer is not None:
            return self._observed_step()
        super().after_step()
        self._period_s += time.perf_counter() - self._iteration_start
        if self._measuring_slowdown():
            self._blocked[(self.step_count - 1) % self.schedule.H].append(
                self.comm.stats.blocked_s - self._blocked_mark
            )
        synced = bool(self._active)
        self.syncs += synced
        if self.step_count % self.schedule.H == 0:
            self._end_period()
        self._begin_iteration()
        return synced

    def _observed_step(self) -> bool:
        """A step timed for the plan: every layer averaged (a synchronous step, so nothing
        drifts), and after the last one the schedule is planned from the steps seen."""
        assert self._observer is not None
        self._observer.update_ended()
        SyncAlgorithm.after_step(self)
        reduce_tensors(self.comm, [p.data for p in self.parameters()])
        self._refs_follow()  # with a codec, changes are sent from the averaged values on
        self.syncs += 1
        self._observe_left -= 1
        if self._observe_left <= 0:
            self._observer.close()
            profile, self._observer = self._observer.profile(self.comm), None
            self._plan_from(profile)
            self.profile = profile
        return True

    def _end_period(self) -> None:
        if self.noise is not None:
            self.noise.exchange(self.comm)
        measured = self.last_period_step_s = self._period_s / self.schedule.H
        self._period_s = 0.0
        if self._fit_slowdown():  # a new plan: its prediction is not what this period ran on
            self._drifted = 0
            return
        if self.config.replan_threshold and self.predicted_step_s and self._profile_fn is not None:
            drift = abs(measured - self.predicted_step_s) / self.predicted_step_s
            # All workers must agree to re-plan, or their collectives would diverge; they refit
            # to the slowest one's step, which paces them all.
            drift, slowest = self.comm.max_scalars([drift, measured])
            # One period off is noise (a first step's allocations, a busy neighbour); a re-plan
            # profiles again and sends probes, so it waits for the drift to persist a second period.
            self._drifted = self._drifted + 1 if drift > self.config.replan_threshold else 0
            if self._drifted >= REPLAN_AFTER_PERIODS:
                self._drifted = 0
                self.replans += 1
                self._refit(slowest)

    def finalize(self) -> None:
        self._land_all_late()
        reduce_tensors(self.comm, [p.data for p in self.parameters()])
        # The references follow the one model (every replica's is it now): a worker whose own
        # average failed adopts a finished one's state, and starts from them.
        self._refs_follow()

    def _land_all_late(self) -> None:
        """Land what is in flight now: the same values as at the layers' next forward, since no
        update comes between (a snapshot, the end of the run)."""
        for i in sorted(self._late):
            self._land_late(i)

    def rebind(self) -> None:
        """A new worker count changes every all-reduce's time: re-plan (profile on the new group)
        and restart the period's bookkeeping; a failed iteration is redone with the same layers."""
        self._forget_in_flight()  # the old group's averages in flight are lost with it
        self._period_s = 0.0
        self._agree_refs()
        if self.comm.world_size > 1:  # one slowdown on every member: a joiner's, or a fit a failure cut
            fitted = [f for f in self.comm.all_gather_object(self.fitted_slowdown) if f is not None]
            self.fitted_slowdown = fitted[0] if fitted else None
        self._periods_planned = 0
        # Every member re-plans below: the drift counted so far is the old plan's, and a failure
        # in a period end's agreement (or in the re-plan it began) leaves survivors one count
        # apart, so that one re-planned, a collective of its own, a period before the others.
        self._drifted = 0
        self._blocked = [[] for _ in range(self.schedule.H)] if self.schedule is not None else []
        if self._profile_fn is not None and self.comm.world_size > 1:
            self.replans += 1
            # Rank 0's profile (a member's: joiners rank last), moved to the group's size: where
            # every worker has one of a group (the same machines), as it is; with a machine new
            # to the group (a joiner's own is none, or of itself alone), its compute measured and
            # the line moved; a whole profile only where there is none to move. Every worker
            # decides alike, on what all of them sent.
            profiles = self.comm.all_gather_object(getattr(self, "profile", None))
            group = [p is not None and int(p.get("workers", 1)) >= 2 for p in profiles]
            moved = profile_for_workers(profiles[0], self.comm.world_size) if group[0] else None
            if moved is not None and all(group):
                self._plan_from(moved)
            else:
                self.reprofiles += 1
                self._replan(link_from=moved)
        if self.schedule is not None:
            self._begin_iteration()

    def roll_back(self) -> None:
        """The old group's averages in flight are lost with it (``rebind`` forgets them too):
        forgotten before the codec's shared entries are rolled back, so that no hand-over's
        capture (``state_dict`` lands what is in flight) lands them, and replaces a factor,
        on its sender alone."""
        self._forget_in_flight()
        super().roll_back()

    def land_in_flight(self) -> None:
        """Lag 1 inside a period: the last iteration's means land now, as a snapshot's capture
        lands them (every member issued them on this group; a codec's second phase is out), so
        an admission's regroup forgets nothing and the joiner takes them with the leader's state.
        Not settled: where a member is lost meanwhile, some members see the new epoch first and
        never land here, or land at their next forward; the regroup's rollback then puts a
        factor a landing replaced (ACP-SGD's, PowerSGD's) back on every member alike."""
        self._land_all_late()

    def _forget_in_flight(self) -> None:
        """Drop the averages in flight without waiting for them (their group failed: a wait
        could be for a lost peer; ``_drop_in_flight`` waits, where every member issued them)."""
        self._inflight, self._late, self._sent = {}, {}, {}

    def _agree_refs(self) -> None:
        """With a codec, the replicas' references must stay one: a failure in the middle of an
        iteration's landings (some workers had landed a layer's mean change when the group
        failed, others not) would leave them apart for good, since every later average lands
        on them. Compared by digest (two floats), and rank 0's taken only where they differ:
        a model's worth of bytes at a regroup on a slow link is minutes."""
        if not self._ref or self.comm.world_size == 1:
            return
        refs = self._refs_by_name()
        flat = flatten(refs)
        if not self.comm.same_everywhere(flat):
            unflatten_into(self.comm.broadcast(flat, src=0), refs)

    def _drop_in_flight(self) -> None:
        """Wait for the averages in flight (every member issued them) and forget them: no work
        is left pending on the group at exit, and none lands on a state restored over it."""
        late = [h for h, _ in self._late.values()]  # a codec's advanced: waiting issues nothing
        for handle in late + list(self._inflight.values()):
            if isinstance(handle, tuple):  # a codec's not advanced: finishing would issue its second phase
                continue
            with contextlib.suppress(Exception):  # a failed group: nothing left to wait for
                handle.wait()
        self._late, self._sent, self._inflight = {}, {}, {}

    def close(self) -> None:
        self._drop_in_flight()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._observer is not None:
            self._observer.close()

    def resolved_options(self) -> dict[str, Any]:
        """H and the codec where ``auto`` chose them; the lag where none was given (1, or 0
        with a codec)."""
        chosen: dict[str, Any] = {"lag": self.lag} if self.config.lag is None else {}
        if self.period_choice and self.schedule:
            chosen["H"] = f"auto ({self.schedule.H})"
        if self.config.compress == AUTO_CODEC and self.schedule:
            chosen["compress"] = f"auto ({self._codec_spec() or 'none'})"
        return chosen

    def default_snapshot_every(self) -> int:
        """The first period boundary at least ``MIN_SNAPSHOT_EVERY`` steps on (not every 2 steps
        at H=2)."""
        H = self.schedule.H if self.schedule is not None else self.config.H
        H = H if isinstance(H, int) else DreamDDPConfig.H  # "auto" not chosen yet (observe())
        return self.snapshot_boundary(H)

    @property
    def parameters_from_state(self) -> bool:  # type: ignore[override]
        # With a codec an adopter starts from the references (each layer's value at its last
        # average, one on every worker): a copy of the leader's parameters would count the
        # leader's progress since twice, at each layer's next average. Without one there is
        # nothing to start from but that copy.
        return bool(self._ref)

    def adopted_state(self) -> None:
        super().adopted_state()
        with torch.no_grad():
            for ref, p in self._ref_pairs():
                p.copy_(ref)

    def _ref_pairs(self):
        """(reference, parameter) of every layer, with a codec (none without)."""
        for layer in self.layers:
            yield from zip(self._ref.get(layer.name, []), layer.params, strict=False)

    def _refs_follow(self) -> None:
        """The references become the parameters (where the replicas are one)."""
        with torch.no_grad():
            for ref, p in self._ref_pairs():
                ref.copy_(p)

    def _refs_by_name(self) -> list[torch.Tensor]:
        """The references in layer-name order: the same on every worker, whatever order a plan
        (a joiner's own, made alone) gave its layers."""
        return [t for name in sorted(self._ref) for t in self._ref[name]]

    def shared_state(self) -> list[torch.Tensor] | None:
        # Each layer is averaged at its own iteration of the period, so no boundary finds the
        # replicas equal; with a codec, the references its messages are taken against are one
        # (``_agree_refs``), by layer name (a plan's order may differ between workers' re-plans).
        return self._refs_by_name() if self._ref else None

    def state_dict(self) -> dict[str, Any]:
        self._land_all_late()  # before the model is read: a snapshot holds no collective in flight
        state = super().state_dict()
        state["layers"] = [layer.name for layer in self.layers]
        state["iterations"] = self.schedule.iterations if self.schedule else None
        state["plan"] = self._plan if self.schedule else None
        state["replans"] = self.replans
        state["reprofiles"] = self.reprofiles
        state["drifted"] = self._drifted
        state["fitted_slowdown"] = self.fitted_slowdown
        if self.codec:
            state["ref"] = {name: list(ts) for name, ts in self._ref.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The plan and the position in its period come back with the step: no re-profiling."""
        self._drop_in_flight()  # a mean taken before the restore must not land on it
        saved = state.get("config", {}).get("compress")
        if self.config.compress == AUTO_CODEC and saved is not None and saved != AUTO_CODEC:
            # A run saved before auto was the default (its config says "", fp32) or with a named
            # codec, resumed at the default: it goes on sending what it sent.
            self.config.compress = saved
            self._use_codec(codec_from_config(self.config, self.chooses_codec))
        if self.config.compress == AUTO_CODEC and state.get("plan") is not None:
            self._adopt_codec(state["plan"])  # the codec chosen, for its state to load into
        super().load_state_dict(state)
        self.replans = int(state.get("replans", 0))
        self.reprofiles = int(state.get("reprofiles", 0))
        self._drifted = int(state.get("drifted", 0))
        self.fitted_slowdown = state.get("fitted_slowdown")
        if state.get("plan") is not None:
            self.set_plan(state["plan"])  # also starts the iteration at step_count % H
        if self.codec:
            with torch.no_grad():
                for name, ts in state["ref"].items():
                    for dst, src in zip(self._ref[name], ts, strict=True):
                        dst.copy_(src)
