"""DreamDDP's planning: profile, price each codec, choose the period and the codec, search the
schedule, re-plan on drift, and fit the link's slowdown under backward from the run's own steps.

A mixin of :class:`geotrain.sync.dreamddp.DreamDDP` (its state lives there: ``schedule``,
``_models``, ``codec``, ``comm``): the methods that turn measurements into a plan, kept apart
from the hooks that carry the plan out during backward. Every collective here (the profile's,
the broadcast of rank 0's schedule, the fit's mean of blocked times) is called by every worker
at the same point, decided on values that are the same everywhere.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, replace
from typing import Any

import torch

from geotrain.compress.codec import Codec, ConfigError, make_codec
from geotrain.plan.codec_time import codec_key
from geotrain.plan.cost import (
    PLAN_HEADROOM,
    ComputeModel,
    LinkModel,
    fit_comm_slowdown,
    fit_link_scale,
    predict_schedule,
    priced_for_codec,
)
from geotrain.plan.profile import build_profile, codec_times, models_from_profile, time_codecs
from geotrain.plan.schedule import (
    AUTO_CODEC,
    AUTO_CODECS,
    ChooseConfig,
    Schedule,
    auto_codecs,
    choose_codec,
    choose_period,
    search_schedule,
)

# The slowdown's fit: periods measured after a plan's first (its steps warm up), and the least
# change of sigma that searches the schedule again.
CALIBRATION_PERIODS = 3
CALIBRATION_STEP = 0.1


class DreamDDPPlanning:
    """What DreamDDP plans with (see the module docstring); not used alone."""

    def _replan(self, link_from: dict[str, Any] | None = None) -> None:
        """Profile and plan; ``link_from``: a profile of this group's links, whose line is
        taken rather than probed (``build_profile``)."""
        assert self._profile_fn is not None
        self._profiling = True
        try:
            codecs = [self.codec.spec()] if self.codec is not None else []
            if self._choosing_codec():
                codecs = [spec for spec in self._auto_codecs() if spec]
            profile = build_profile(
                self.module, self.layers, self._profile_fn, self.optimizer, self.comm, codecs=codecs,
                link_from=link_from,
            )  # fmt: skip
        finally:
            self._profiling = False
        self._plan_from(profile)

    def _plan_from(self, profile: dict[str, Any]) -> None:
        compute, link = models_from_profile(profile)
        if self.fitted_slowdown is not None:  # measured in training: a profile's probe was not
            compute = replace(compute, comm_slowdown=self.fitted_slowdown)
        H = self._choose_codec(compute, link, profile) if self._choosing_codec() else None
        self._plan_with(self._priced(compute, self.codec, profile), link, H)
        self.profile = profile

    def _auto_codecs(self) -> tuple[str, ...]:
        """The codecs ``--compress auto`` weighs under this run's ``--aggregate``."""
        return auto_codecs(getattr(self.comm, "aggregate", "mean"))

    def _choosing_codec(self) -> bool:
        return self.config.compress == AUTO_CODEC and self.codec_choice is None

    def _choose_codec(self, compute: ComputeModel, link: LinkModel, profile: dict[str, Any]) -> int | None:
        """``compress="auto"``: choose the codec (and with ``H="auto"`` the period, returned;
        else None) by predicted time to a loss (``choose_codec``), rank 0's choice on every
        worker, and adopt it. Codecs the profile did not time (steps observed, not profiled)
        are timed here first: without their encoding a codec would look free."""
        weighed = self._auto_codecs()
        specs = [spec for spec in weighed if spec]
        if not all(codec_key(spec) in profile.get("codecs", {}) for spec in specs):
            profile.setdefault("codecs", {}).update(time_codecs(self.layers, self.comm, specs))
        candidates = {}  # keyed by the full spec, as `geotrain plan --compress auto` names them
        for spec in weighed:
            codec = make_codec(spec) if spec else None
            key = codec.spec() if codec is not None else ""
            candidates[key] = (self._priced(compute, codec, profile), link, self._lag_with(codec))
        H = None if self.config.H == "auto" else min(int(self.config.H), compute.n_layers)
        spec, chosen_H, table = choose_codec(
            candidates,
            H,
            ChooseConfig(budget=math.inf, max_H=compute.n_layers),
            fill_in=self.config.fill_in,
            headroom=PLAN_HEADROOM,
        )
        spec, chosen_H, table = self.comm.all_gather_object((spec, chosen_H, table))[0]
        self.codec_choice = table
        self._adopt_codec({"codec": spec})
        if H is not None:
            return None
        mine = [row for row in table if row["codec"] == spec]
        self.period_choice = [{k: v for k, v in row.items() if k != "codec"} for row in mine]
        return chosen_H

    def _adopt_codec(self, plan: dict[str, Any]) -> None:
        """Send through the codec a plan chose (``plan["codec"]``, "" for none; ``_use_codec``),
        or, from a plan that chose none, the codec it was priced for where auto could choose it."""
        spec = plan.get("codec")
        if spec is None:  # `geotrain plan` without --compress auto: the codec it priced, if a candidate
            spec = str(plan.get("models", {}).get("codec", "")).rsplit(" x", 1)[0]
            if spec not in {codec_key(c) if c else "" for c in AUTO_CODECS}:
                raise ConfigError(
                    f"--compress auto (dreamddp's default) chooses among fp32, "
                    f"{', '.join(c for c in AUTO_CODECS if c)}, and this plan "
                    f"was priced for {spec}: give the run --compress {spec}, or make the plan with "
                    "`geotrain plan --compress auto`"
                )
            if self.codec_choice is None:
                self.notice(
                    f"--compress auto takes the plan's codec ({spec or 'none: fp32'}); "
                    "`geotrain plan --compress auto` makes a plan that chooses",
                )
        # The plan's table where it has one (a joiner's own, made alone before it joined, is not
        # what the group chose); chosen, never again: the replicas differ from here on.
        if plan.get("codec_choice") or self.codec_choice is None:
            self.codec_choice = plan.get("codec_choice") or []
        if self._codec_spec() != (codec_key(spec) if spec else ""):
            self._use_codec(make_codec(spec) if spec else None)

    def _use_codec(self, codec: Codec | None) -> None:
        """Send through ``codec`` (None: fp32), with its reference copy of each layer, keyed by
        name (a re-plan reorders the layers), taken now: where the replicas are one, or where a
        state is about to be loaded over it."""
        self.codec = codec
        self._ref = (
            {layer.name: [p.detach().clone() for p in layer.params] for layer in self.layers}
            if codec is not None
            else {}
        )

    def _codec_spec(self) -> str:
        return self.codec.spec() if self.codec is not None else ""

    def _codec_key(self) -> str:
        """What the models a plan holds were priced for: this codec among this many workers."""
        return f"{self.codec.spec()} x{self.comm.world_size}" if self.codec is not None else ""

    def _priced(
        self, compute: ComputeModel, codec: Codec | None, profile: dict[str, Any] | None = None
    ) -> ComputeModel:
        """A profile's compute model (plain all-reduces) with ``codec``'s messages priced (None:
        as it is), and its encoding where ``profile`` timed it."""
        if codec is None:
            return compute
        by_name = {layer.name: layer for layer in self.layers}
        shapes = [[tuple(p.shape) for p in by_name[name].params] for name in compute.names]
        workers = self.comm.world_size
        timed = codec_times(profile, compute, codec.spec(), workers) if profile is not None else ()
        return priced_for_codec(compute, codec, shapes, workers, timed)

    def _refit(self, measured_s: float) -> None:
        """A re-plan from the steps already measured (``measured_s``, the slowest worker's mean
        over the drifting period, the same on every worker): the link's times scaled to what
        they were (``fit_link_scale``), the schedule searched again on them. A new profile only
        where no scale explains it (the compute changed) or no models are at hand."""
        models = self._models
        k = fit_link_scale(*models, self.schedule.iterations, measured_s, self.lag) if models else None
        if k is None:
            self.reprofiles += 1
            self._replan()
            return
        compute, link = models
        profile = getattr(self, "profile", None)
        if profile is not None:  # a later regroup moves the line the run measured, not the first
            line = profile["allreduce"]
            scaled = {"alpha_s": line["alpha_s"] * k, "beta_s_per_byte": line["beta_s_per_byte"] * k}
            self.profile = {**profile, "allreduce": {**line, **scaled}}
        self._plan_with(compute, link.scaled(k))

    def _plan_with(self, compute: ComputeModel, link: LinkModel, H: int | None = None) -> None:
        """The schedule searched on these models, broadcast from rank 0 and adopted; ``H``: a
        period already chosen (``--compress auto`` with ``--H auto`` chooses both at once). A
        re-plan at the period in use keeps the schedule in use where the search (its time budget
        spent) found none predicted faster on these models."""
        choice = self.period_choice  # --H auto's table, kept through re-plans
        if H is None and self.config.H == "auto":  # chosen once, at the first plan; a re-plan keeps it
            H, choice = self._choose_period(compute, link)
        elif H is None:
            H = min(self.config.H, compute.n_layers)
        schedule = search_schedule(
            compute, link, H, fill_in=self.config.fill_in, lag=self.lag, headroom=PLAN_HEADROOM
        )
        in_use = self.schedule
        if in_use is not None and in_use.H == H and self._plan["schedule"]["layers"] == list(compute.names):
            kept = [list(layers) for layers in in_use.iterations]
            if predict_schedule(compute, link, kept, self.lag) <= predict_schedule(
                compute, link, schedule.iterations, self.lag
            ):
                schedule = Schedule(H, list(in_use.assignment), kept, lag=self.lag)
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
                "lag": self.lag,
                "layers": list(compute.names),
                "assignment": schedule.assignment,
                "iterations": [[compute.names[i] for i in it] for it in schedule.iterations],
            },
            "predicted_s": {"dreamddp": predict_schedule(compute, link, schedule.iterations, self.lag)},
            # what the schedule was searched on (a codec's messages priced): a re-plan refits these
            "models": {"compute": asdict(compute), "link": asdict(link), "codec": self._codec_key()},
            "period_choice": choice,  # --H auto: the periods weighed (rank 0's table)
            # --compress auto: what was chosen (a resumed run takes it) and what was weighed
            **({"codec": self._codec_spec()} if self.config.compress == AUTO_CODEC else {}),
            **({"codec_choice": self.codec_choice} if self.codec_choice else {}),
        }
        self.set_plan(plan)

    def _choose_period(self, compute: ComputeModel, link: LinkModel) -> tuple[int, list[dict]]:
        """``H="auto"``: by predicted time to a loss, a shorter period learning more per token
        (``ChooseConfig``'s penalty, measured) and costing more link time per step; any period
        up to one layer per iteration (no budget: on a slow link the step time decides). Rank 0's
        choice and table (the searches have a time budget, so workers could differ)."""
        H, table = choose_period(
            compute,
            link,
            ChooseConfig(budget=math.inf, max_H=compute.n_layers),
            fill_in=self.config.fill_in,
            lag=self.lag,
            headroom=PLAN_HEADROOM,
        )
        return self.comm.all_gather_object((H, table))[0]

    def _fit_slowdown(self) -> bool:
        """Once, ``CALIBRATION_PERIODS`` periods into a plan (after its first): the link's
        slowdown under backward fitted to the seconds each step of the period was blocked
        (``fit_comm_slowdown``; each step's median over the periods, averaged over workers, so
        every worker fits the same), and where it moved by ``CALIBRATION_STEP`` or more, the
        schedule searched again with it. Not with a codec landing late (part of an iteration's
        wait then falls in its own step, part in the next), nor where re-plans are off, nor for a
        plan without the models it was searched on (one older than them). Called at a period's
        end before the drift check, so that a re-plan there restarts the count (its plan's first
        period then warms up). Returns whether it re-planned."""
        self._periods_planned += 1
        if self._periods_planned != 1 + CALIBRATION_PERIODS or not self._slowdown_fits():
            return False
        compute, link = self._models
        medians = [statistics.median(b) if b else 0.0 for b in self._blocked]
        measured = self.comm.mean_scalars(medians)
        sigma, _ = fit_comm_slowdown(compute, link, self.schedule.iterations, measured, self.lag)
        self.fitted_slowdown = sigma
        if abs(sigma - compute.comm_slowdown) < CALIBRATION_STEP:
            return False
        self.replans += 1
        self._plan_with(replace(compute, comm_slowdown=sigma), link)
        return True

    def _slowdown_fits(self) -> bool:
        """Whether the slowdown's fit can run on this plan (``_fit_slowdown``): once per run,
        with re-plans on, the plan's models at hand and no codec landing late."""
        models = self._models
        return (
            self.fitted_slowdown is None
            and bool(self.config.replan_threshold)
            and models is not None
            and not (self.lag and models[0].tail_bytes)
        )

    def _measuring_slowdown(self) -> bool:
        """Whether this step's blocked seconds count towards the fit: in the
        ``CALIBRATION_PERIODS`` periods after a plan's first, which warms up."""
        return 1 <= self._periods_planned <= CALIBRATION_PERIODS and self._slowdown_fits()
