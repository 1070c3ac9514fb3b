"""A schedule for the period H of a periodic method (``--H-schedule``): short periods first,
then longer ones as training settles.

Local SGD drifts most where the loss falls fastest, at the start; later the replicas move
less between syncs and a long period costs little (Haddadpour et al. 2019, "Local SGD with
periodic averaging: tighter analysis and adaptive synchronization", grow the number of local
steps over training; post-local SGD, Lin et al. 2020, is the two-stage case, which geotrain
runs as ``--warm-start``). A schedule is a list of stages, each a period p_k used for at least
n_k steps, then the run's H to the end:

- ``grow``: the divisors of H from 2 up, each at least twice the one before (2, 5 for H=10;
  2, 4, 8 for H=16; 2, 4, 10 for H=20), each for ``every`` steps (``grow:every=E,start=P``; the
  training config resolves ``every`` from the planned steps when not given: a tenth of them).
  Divisors of H, so that a stage's rounded end (below) comes at most H steps late;
- ``P1xN1,P2xN2,...``: the stages spelled out, e.g. ``2x50,5x100`` then H.

The syncs fall at the multiples of the period in force, counted from step 0, as they do with
a fixed H: every worker finds them from its own step count, with no communication, and the
membership layer's rule (the next boundary is the next multiple of the period, ``sync_period``)
stays true. For that a stage ends at a step both its period and the next one divide (the
stated length rounded up to a multiple of their least common multiple), so the step that
changes the period is a sync under both. A warm start (``warm_start`` W) comes first: the
schedule's first stage begins at step W.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from geotrain.compress.codec import ConfigError

GROW = "grow"


@dataclass(frozen=True)
class Stage:
    period: int
    steps: int  # at least this many steps at ``period`` (the last stage, H, runs to the end: 0)


@dataclass(frozen=True)
class Periods:
    """The period in force at each step: ``starts[k]`` is the first step (counted from 0) of
    stage k, whose period is ``periods[k]``; the last stage's period is H."""

    starts: tuple[int, ...]
    periods: tuple[int, ...]

    @classmethod
    def fixed(cls, H: int) -> Periods:
        return cls((0,), (H,))

    @classmethod
    def build(cls, stages: list[Stage], H: int, first: int = 0) -> Periods:
        """The stages, then H, the first beginning at step ``first`` (after a warm start)."""
        starts, periods = [first], []
        for k, stage in enumerate(stages):
            periods.append(stage.period)
            following = stages[k + 1].period if k + 1 < len(stages) else H
            both = math.lcm(stage.period, following)
            starts.append(-(-(starts[-1] + stage.steps) // both) * both)
        periods.append(H)
        return cls(tuple(starts), tuple(periods))

    def period(self, step: int) -> int:
        """The period of the step under way when ``step`` steps are done."""
        return self.periods[max(0, bisect_right(self.starts, step) - 1)]

    def is_boundary(self, done: int) -> bool:
        """``done`` steps are done and the last of them ends a period (a sync)."""
        return done > 0 and done % self.period(done - 1) == 0

    @property
    def grows(self) -> bool:
        return len(self.periods) > 1

    def common_multiple(self) -> int:
        """The least step count that is a boundary of every stage's period."""
        return math.lcm(*self.periods)

    def boundaries(self, start: int, stop: int) -> list[int]:
        """The step counts in (start, stop] that end a period."""
        return [done for done in range(start + 1, stop + 1) if self.is_boundary(done)]

    def describe(self) -> str:
        if not self.grows:
            return f"H={self.periods[0]}"
        parts = [f"{p} from step {s}" for s, p in zip(self.starts, self.periods, strict=True)]
        return "H " + ", ".join(parts)


def parse_stages(spec: str, H: int) -> list[Stage]:
    """``--H-schedule``'s stages (see the module docstring); "" for none. ``grow`` must have its
    ``every`` by now (``resolve_every``)."""
    spec = spec.strip()
    if not spec:
        return []
    if spec.split(":")[0] == GROW:
        options = _grow_options(spec)
        if "every" not in options:
            raise ConfigError(f"--H-schedule {spec!r}: give grow:every=STEPS (the training config sets it)")
        start, every = options.get("start", 2), options["every"]
        periods: list[int] = []
        for d in range(start, H):  # H's divisors, each at least twice the last: 2, 5 for H=10
            if H % d == 0 and (not periods or d >= 2 * periods[-1]):
                periods.append(d)
        if not periods:
            raise ConfigError(
                f"--H-schedule grow takes its periods from the divisors of H from {start} up: H={H} has "
                "none; give the stages (e.g. 2x50,4x50) or an H such as 8, 10, 12, 16 or 20"
            )
        return [Stage(p, every) for p in periods]
    stages = []
    for part in spec.split(","):
        period, x, steps = part.strip().partition("x")
        try:
            stage = Stage(int(period), int(steps))
        except ValueError:
            stage = Stage(0, 0)
        if not x or stage.period < 1 or stage.steps < 1:
            raise ConfigError(
                f"--H-schedule takes grow[:every=STEPS,start=P] or PERIODxSTEPS,... (e.g. 2x50,5x100, then "
                f"--H to the end), each period and length >= 1; got {part.strip()!r} in {spec!r}"
            )
        stages.append(stage)
    return stages


def check_schedule(spec: str, H: int, pace: str = "steps", site_H: int = 0) -> None:
    """A config's ``H_schedule`` (``LocalSGDConfig``, ``DiLoCoConfig``): parsed, its periods
    rising below H, no stage stretched far by the rounding of its end, and not combined with
    the options planned on a fixed period. Raises ConfigError with what to change."""
    stages = parse_stages(spec, H)
    if not stages:
        return
    if pace == "time" or site_H:
        raise ConfigError(
            "--H-schedule changes the period as the run goes, and --pace time and --site-H are planned "
            "on a fixed one: drop --H-schedule, or --pace time and --site-H"
        )
    periods = [stage.period for stage in stages] + [H]
    # Rising: a member whose sync failed at a stage's end reports the next period, and the
    # membership layer takes the least period among members as the window they share.
    if any(a >= b for a, b in zip(periods, periods[1:], strict=False)):
        raise ConfigError(
            f"--H-schedule {spec!r}: the periods must rise, each below the next and below H={H} "
            f"(got {', '.join(map(str, periods))})"
        )
    for a, b in zip(periods, periods[1:], strict=False):
        if math.lcm(a, b) > 4 * H:
            raise ConfigError(
                f"--H-schedule {spec!r}: a stage of {a} ends where both {a} and {b} sync, a multiple of "
                f"{math.lcm(a, b)}, over 4 H late: choose periods that divide H (or each other)"
            )


def _grow_options(spec: str) -> dict[str, int]:
    _, _, rest = spec.partition(":")
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        name, eq, value = item.partition("=")
        try:
            number = int(value)
        except ValueError:
            number = 0
        if not eq or name not in ("every", "start") or number < 1 or name in out:
            raise ConfigError(
                f"--H-schedule grow takes every=STEPS and start=PERIOD, each once and >= 1 (e.g. "
                f"grow:every=100,start=2); got {item!r}"
            )
        out[name] = number
    return out


def resolve_every(spec: str, planned_steps: int) -> str:
    """``grow`` without ``every``: a tenth of the planned steps (at least 1), written into the
    spec so the saved config (a resume) keeps it; any other spec unchanged."""
    spec = spec.strip()
    if spec.split(":")[0] != GROW or "every" in _grow_options(spec):
        return spec
    every = f"every={max(1, planned_steps // 10)}"
    return f"{spec},{every}" if ":" in spec else f"{GROW}:{every}"


def periods_for(spec: str, H: int, warm_start: int = 0) -> Periods:
    """The periods of a method with period H, ``spec`` its ``--H-schedule``, after a warm start."""
    stages = parse_stages(spec, H)
    return Periods.build(stages, H, warm_start) if stages else Periods.fixed(H)
