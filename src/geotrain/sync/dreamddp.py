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

The schedule comes from ``geotrain plan`` (``plan_path``) or is made at start-up from a quick
profile (``prepare``). Beyond the paper: at each period boundary the measured iteration time is
compared with the plan's prediction, and if they differ by more than ``replan_threshold`` (the link
got slower, a worker got busier) in two periods running, the workers profile again and re-plan.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from geotrain.comm.buckets import flatten, reduce_tensors, unflatten_into
from geotrain.compress.codec import ConfigError
from geotrain.plan.cost import (
    ComputeModel,
    LinkModel,
    fit_link_scale,
    predict_schedule,
    priced_for_codec,
    unpriced,
)
from geotrain.plan.layers import layer_groups, order_layers
from geotrain.plan.profile import StepObserver, build_profile, codec_times, models_from_profile
from geotrain.plan.schedule import Schedule, schedule_from_json, search_schedule
from geotrain.sync.base import SyncAlgorithm, SyncConfig, adopt_mean_change, require


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """A ComputeModel's fields read back from JSON: its lists as the tuples it holds."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


REPLAN_AFTER_PERIODS = 2  # periods in a row that must drift before a re-plan
OBSERVED_STEPS = 3  # steps timed for the plan when no loss function is given (after a warm-up)


@dataclass
class DreamDDPConfig(SyncConfig):
    H: int = 10
    plan_path: str = ""  # a plan from `geotrain plan`; "": profile and plan at start-up
    fill_in: bool = True
    replan_threshold: float = 0.25  # relative drift of measured from predicted time; 0: never re-plan
    compress: str = ""  # a codec spec (geotrain.compress); "": uncompressed

    def __post_init__(self) -> None:
        require(
            isinstance(self.H, int) and self.H >= 1,
            f"H (the schedule's period in iterations) must be an integer >= 1, got {self.H}",
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


class DreamDDP(SyncAlgorithm):
    local_steps = True  # each layer is averaged once per period; the optimizers are each worker's
    # --lr-scale auto: measured from a period's first step, where each layer was averaged within
    # the last period (not all at once: the measure includes their small drift since), at its end
    measures_noise = True
    name = "dreamddp"

    def __init__(self, model, optimizer, comm, config: DreamDDPConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or DreamDDPConfig())
        self.layers = layer_groups(model)
        # Keyed by layer name: a re-plan reorders the layers.
        self._ref = (
            {layer.name: [p.detach().clone() for p in layer.params] for layer in self.layers}
            if self.codec
            else {}
        )
        self.schedule: Schedule | None = None
        self.predicted_step_s: float | None = None
        self.replans = 0
        self.reprofiles = 0  # re-plans that profiled again (a new group, or a drift no refit explains)
        self._models: tuple[ComputeModel, LinkModel] | None = None  # what the plan was searched on
        self._drifted = 0  # consecutive periods off the prediction by more than replan_threshold
        self._owner = {id(p): i for i, layer in enumerate(self.layers) for p in layer.params}
        self._active: set[int] = set()
        self._ready = [0] * len(self.layers)
        self._inflight: dict[int, Any] = {}
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
        self._hooks.append(model.register_forward_pre_hook(self._on_forward))
        if self.config.plan_path:
            try:
                self.set_plan(json.loads(Path(self.config.plan_path).read_text()))
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(
                    f"plan {self.config.plan_path!r} does not fit this model ({type(e).__name__}: {e}); "
                    "make one with `geotrain plan` for it"
                ) from None

    # -- planning -----------------------------------------------------------------------------
    def set_plan(self, plan: dict[str, Any]) -> None:
        """Adopt a plan (``geotrain plan`` output): the backward order of layers and the schedule."""
        schedule, names = schedule_from_json(plan["schedule"])
        if self._observer is not None:  # a plan came (a restored state): no steps to time
            self._observer.close()
            self._observer = None
        self.layers = order_layers(self.layers, names)
        self._owner = {id(p): i for i, layer in enumerate(self.layers) for p in layer.params}
        self._ready = [0] * len(self.layers)
        self.schedule = schedule
        self._plan = plan
        self.config.H = schedule.H
        self.predicted_step_s = plan.get("predicted_s", {}).get("dreamddp")
        models = plan.get("models")
        self._models = None
        if models:
            compute, link = ComputeModel(**_tuples(models["compute"])), LinkModel(**models["link"])
            priced_for, mine = models.get("codec", ""), self._codec_key()
            if priced_for != mine and compute.raw_nbytes:  # another codec's or group's: unpriced
                if self.comm.rank == 0:
                    print(
                        f"geotrain: the plan was priced for {priced_for}, this run sends "
                        f"{mine or 'fp32 all-reduces'}: its schedule is kept, its messages priced again",
                        file=sys.stderr,
                        flush=True,
                    )
                compute, priced_for = unpriced(compute), ""
            if not priced_for and self.codec is not None:  # `geotrain plan`'s: plain all-reduces
                compute, priced_for = self._priced(compute), mine
            if priced_for != models.get("codec", ""):
                self.predicted_step_s = predict_schedule(compute, link, schedule.iterations)
            # priced for what cannot be undone (a plan older than raw sizes): a re-plan profiles again
            self._models = (compute, link) if priced_for == mine else None
        self._begin_iteration()

    def prepare(self, loss_fn: Callable[[], torch.Tensor]) -> None:
        """Profile and plan on all workers if no plan was given (called once before training)."""
        self._profile_fn = loss_fn
        if self.schedule is None:
            self._replan()

    def observe(self, steps: int = OBSERVED_STEPS) -> None:
        """No plan and no loss function to profile with (``geotrain.wrap`` without either): the
        first ``steps`` + 1 training steps are timed as they run (``StepObserver``), every layer
        averaged at each of them so that no replica drifts meanwhile, and the schedule is
        planned from what they measured."""
        if self.schedule is None:
            self._observer = StepObserver(self.module, self.layers)
            self._observe_left = steps + 1  # the first is a warm-up

    def _replan(self) -> None:
        assert self._profile_fn is not None
        self._profiling = True
        try:
            codecs = [self.codec.spec()] if self.codec is not None else []
            profile = build_profile(
                self.module, self.layers, self._profile_fn, self.optimizer, self.comm, codecs=codecs
            )
        finally:
            self._profiling = False
        self._plan_from(profile)

    def _plan_from(self, profile: dict[str, Any]) -> None:
        compute, link = models_from_profile(profile)
        self._plan_with(self._priced(compute, profile), link)
        self.profile = profile

    def _codec_key(self) -> str:
        """What the models a plan holds were priced for: this codec among this many workers."""
        return f"{self.codec.spec()} x{self.comm.world_size}" if self.codec is not None else ""

    def _priced(self, compute: ComputeModel, profile: dict[str, Any] | None = None) -> ComputeModel:
        """A profile's compute model (plain all-reduces) with this run's codec messages priced,
        and its encoding where ``profile`` timed it."""
        if self.codec is None:
            return compute
        by_name = {layer.name: layer for layer in self.layers}
        shapes = [[tuple(p.shape) for p in by_name[name].params] for name in compute.names]
        workers = self.comm.world_size
        timed = codec_times(profile, compute, self.codec.spec(), workers) if profile is not None else ()
        return priced_for_codec(compute, self.codec, shapes, workers, timed)

    def _refit(self, measured_s: float) -> None:
        """A re-plan from the steps already measured (``measured_s``, the slowest worker's mean
        over the drifting period, the same on every worker): the link's times scaled to what
        they were (``fit_link_scale``), the schedule searched again on them. A new profile only
        where no scale explains it (the compute changed) or no models are at hand."""
        models = self._models
        k = fit_link_scale(*models, self.schedule.iterations, measured_s) if models else None
        if k is None:
            self.reprofiles += 1
            self._replan()
            return
        compute, link = models
        self._plan_with(compute, LinkModel(link.alpha_s * k, link.beta_s_per_byte * k))

    def _plan_with(self, compute: ComputeModel, link: LinkModel) -> None:
        H = min(self.config.H, compute.n_layers)
        schedule = search_schedule(compute, link, H, fill_in=self.config.fill_in)
        # The search has a time budget, so workers could differ: everyone takes rank 0's schedule.
        matrix = torch.zeros(H, compute.n_layers, dtype=torch.uint8)
        for h, layers in enumerate(schedule.iterations):
            matrix[h, layers] = 1
        matrix = self.comm.broadcast(matrix, src=0)
        schedule.iterations = [matrix[h].nonzero().flatten().tolist() for h in range(H)]
        assignment = torch.tensor(schedule.assignment, dtype=torch.int64)
        schedule.assignment = self.comm.broadcast(assignment, src=0).tolist()
        plan = {
            "schedule": {
                "H": H,
                "layers": list(compute.names),
                "assignment": schedule.assignment,
                "iterations": [[compute.names[i] for i in it] for it in schedule.iterations],
            },
            "predicted_s": {"dreamddp": predict_schedule(compute, link, schedule.iterations)},
            # what the schedule was searched on (a codec's messages priced): a re-plan refits these
            "models": {"compute": asdict(compute), "link": asdict(link), "codec": self._codec_key()},
        }
        self.set_plan(plan)

    # -- one iteration ------------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        assert self.schedule is not None
        self._active = set(self.schedule.iterations[self.step_count % self.schedule.H])
        self._ready = [0] * len(self.layers)
        self._inflight = {}

    def _on_forward(self, module, args) -> None:
        if module.training and not self._profiling:
            self._iteration_start = time.perf_counter()

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
        params = [p.detach() for p in self.layers[i].params]
        if self.codec is not None:
            name = self.layers[i].name
            deltas = [p - ref for p, ref in zip(params, self._ref[name], strict=True)]
            self._inflight[i] = (self.codec.reduce(self.comm, name, deltas), deltas)
            return
        self._inflight[i] = self.comm.all_reduce(flatten(params), op="mean", async_op=True)

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
        with torch.no_grad():
            for i, handle in self._inflight.items():
                if self.codec is not None:
                    message, deltas = handle
                    message.wait()
                    params = [p.data for p in self.layers[i].params]
                    adopt_mean_change(params, self._ref[self.layers[i].name], deltas)
                    continue
                unflatten_into(handle.wait(), [p.data for p in self.layers[i].params])
        self._inflight = {}  # free the send buffers now, not at the next iteration

    def after_step(self) -> bool:
        if self.schedule is None and self._observer is not None:
            return self._observed_step()
        super().after_step()
        self._period_s += time.perf_counter() - self._iteration_start
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
        with torch.no_grad():  # with a codec, changes are sent from the averaged values on
            for layer in self.layers:
                for ref, p in zip(self._ref.get(layer.name, []), layer.params, strict=False):
                    ref.copy_(p)
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
        measured = self._period_s / self.schedule.H
        self.last_period_step_s = measured
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
        self._period_s = 0.0

    def finalize(self) -> None:
        reduce_tensors(self.comm, [p.data for p in self.parameters()])

    def rebind(self) -> None:
        """A new worker count changes every all-reduce's time: re-plan (profile on the new group)
        and restart the period's bookkeeping; a failed iteration is redone with the same layers."""
        self._inflight = {}
        self._period_s = 0.0
        if self._profile_fn is not None and self.comm.world_size > 1:
            self.replans += 1
            self.reprofiles += 1
            self._replan()
        if self.schedule is not None:
            self._begin_iteration()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._observer is not None:
            self._observer.close()

    def default_snapshot_every(self) -> int:
        return self.config.H  # each sync boundary, where the replicas share the most

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["layers"] = [layer.name for layer in self.layers]
        state["iterations"] = self.schedule.iterations if self.schedule else None
        state["plan"] = self._plan if self.schedule else None
        state["replans"] = self.replans
        state["reprofiles"] = self.reprofiles
        state["drifted"] = self._drifted
        if self.codec:
            state["ref"] = {name: list(ts) for name, ts in self._ref.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The plan and the position in its period come back with the step: no re-profiling."""
        super().load_state_dict(state)
        self.replans = int(state.get("replans", 0))
        self.reprofiles = int(state.get("reprofiles", 0))
        self._drifted = int(state.get("drifted", 0))
        if state.get("plan") is not None:
            self.set_plan(state["plan"])  # also starts the iteration at step_count % H
        if self.codec:
            with torch.no_grad():
                for name, ts in state["ref"].items():
                    for dst, src in zip(self._ref[name], ts, strict=True):
                        dst.copy_(src)
