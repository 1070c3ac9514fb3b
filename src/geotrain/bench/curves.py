"""Loss curves from a run's metrics, and the time (or tokens) at which a curve reaches a target.

A validation curve is sampled every few steps; the target is reached between two samples, so the
crossing is interpolated linearly between the last point above and the first at or below it. A
curve that never reaches the target has no time to target: ``None``, never a number.

Each evaluation is a loss on a few batches and wobbles by a few thousandths; near a plateau one low
evaluation would decide the crossing. ``smooth`` (a centred moving mean over ``window``
evaluations, narrower at the ends) is applied to every curve alike before it is read, the target's
curve included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from geotrain.metrics import read_metrics


@dataclass
class Curve:
    """Validation loss against training time (seconds, evaluation excluded) and tokens."""

    train_s: list[float]
    tokens: list[int]
    val_loss: list[float]
    steps: list[int] = field(default_factory=list)  # the step of each point (may be absent)

    def __post_init__(self) -> None:
        if not (len(self.train_s) == len(self.tokens) == len(self.val_loss)):
            raise ValueError("a curve needs as many times and token counts as losses")
        if self.steps and len(self.steps) != len(self.val_loss):
            raise ValueError("a curve needs a step for each loss, or none")


def crossing(xs: list[float], losses: list[float], target: float) -> float | None:
    """The first x where the piecewise-linear curve (xs, losses) reaches ``target``, or None."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return xs[0]
            x0, x1, l0 = xs[i - 1], xs[i], losses[i - 1]
            return x0 + (x1 - x0) * (l0 - target) / (l0 - loss)
    return None


def smooth(losses: list[float], window: int) -> list[float]:
    """The centred moving mean over ``window`` (odd, >= 1) points; at the ends, over the points
    there are (the last point is the mean of the last ``window // 2 + 1``)."""
    if window < 1 or window % 2 == 0:
        raise ValueError(f"the smoothing window must be an odd number >= 1, got {window}")
    half = window // 2
    return [
        sum(part) / len(part)
        for i in range(len(losses))
        for part in [losses[max(0, i - half) : i + half + 1]]
    ]


def time_to_target(curve: Curve, target: float, window: int = 1) -> float | None:
    return crossing(curve.train_s, smooth(curve.val_loss, window), target)


def tokens_to_target(curve: Curve, target: float, window: int = 1) -> float | None:
    return crossing([float(t) for t in curve.tokens], smooth(curve.val_loss, window), target)


def final_loss(curve: Curve, window: int = 1) -> float | None:
    """The smoothed curve's last value: a target that one low last evaluation does not set."""
    return smooth(curve.val_loss, window)[-1] if curve.val_loss else None


def read_curve(run_dir: Path, rank: int = 0, replicas: bool = False) -> Curve:
    """The validation points rank ``rank`` recorded (losses are already averaged over workers).

    A loopback run scores the replicas' mean model mid-run (``--eval-model auto``) and records
    the replicas' own losses beside it; ``replicas`` reads those where they were recorded, to
    compare with a shaped run, which scores the replicas."""
    points = [r for r in read_metrics(Path(run_dir) / "metrics" / f"rank{rank}.jsonl") if "val_loss" in r]
    key = "val_loss_replicas" if replicas else "val_loss"
    return Curve(
        [float(r["train_s"]) for r in points],
        [int(r["tokens"]) for r in points],
        [float(r.get(key, r["val_loss"])) for r in points],
        [int(r["step"]) for r in points],
    )


def step_times(records: list[dict]) -> dict[bool, float]:
    """A run's mean step time for the steps that synchronised and for those that did not
    (``synced`` in its metrics; the first step, which pays for allocation, left out). Where a
    run has only one kind, both are that kind's mean."""
    steady = [r for r in records if not r.get("final")][1:] or [r for r in records if not r.get("final")]
    if not steady:
        raise ValueError("no step metrics to time")
    mean = {}
    for kind in (True, False):
        times = [r["step_s"] for r in steady if bool(r["synced"]) == kind]
        if times:
            mean[kind] = sum(times) / len(times)
    return {kind: mean.get(kind, mean.get(not kind)) for kind in (True, False)}


def compose(per_token: Curve, synced: list[bool], step_s: dict[bool, float]) -> Curve:
    """The long-horizon measure: the loss at each step of a long run on loopback (same workers,
    seeds and batches as on the shaped links), at the time that step would be reached on the
    shaped links: the sum, over the steps up to it, of the shaped run's mean time for a step of
    its kind (``synced[i]``: whether step i + 1 of the long run synchronised). A periodic
    method's syncs are then counted as often as the long run made them, not as the short one."""
    if not per_token.steps:
        raise ValueError("composing a curve needs the step of each point")
    if min(step_s.values()) <= 0:
        raise ValueError(f"step times must be > 0, got {step_s}")
    if len(synced) < per_token.steps[-1]:
        raise ValueError(
            f"the long run has {len(synced)} steps timed, its curve goes to {per_token.steps[-1]}"
        )
    elapsed, at = 0.0, [0.0]
    for kind in synced:
        elapsed += step_s[bool(kind)]
        at.append(elapsed)
    return Curve([at[s] for s in per_token.steps], per_token.tokens, per_token.val_loss, per_token.steps)


def agreement(composed: Curve, measured: Curve) -> dict[str, float | int] | None:
    """How far the composed curve is from a real run on the shaped links over the steps both
    evaluated: the largest loss difference at the same step, and the time of the last common
    point, composed over measured (1.0: the same). None if they share no step.

    A shorter run's last point is its end-of-run model (the replicas averaged, for the periodic
    methods), which the longer run does not have at that step: it is left out."""
    at = dict(zip(composed.steps, zip(composed.train_s, composed.val_loss, strict=True), strict=True))
    if measured.steps and composed.steps and measured.steps[-1] < composed.steps[-1]:
        measured = Curve(
            measured.train_s[:-1], measured.tokens[:-1], measured.val_loss[:-1], measured.steps[:-1]
        )
    common = [
        (s, t, v)
        for s, t, v in zip(measured.steps, measured.train_s, measured.val_loss, strict=True)
        if s in at
    ]
    if not common:
        return None
    step, real_s, _ = common[-1]
    return {
        "steps_compared": step,
        "max_loss_diff": max(abs(at[s][1] - v) for s, _, v in common),
        "time_ratio": at[step][0] / real_s if real_s > 0 else float("nan"),
    }
