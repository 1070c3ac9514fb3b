"""Loss curves from a run's metrics, and the time (or tokens) at which a curve reaches a target.

A validation curve is sampled every few steps; the target is reached between two samples, so the
crossing is interpolated linearly between the last point above and the first at or below it. A
curve that never reaches the target has no time to target: ``None``, never a number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geotrain.metrics import read_metrics


@dataclass
class Curve:
    """Validation loss against training time (seconds, evaluation excluded) and tokens."""

    train_s: list[float]
    tokens: list[int]
    val_loss: list[float]

    def __post_init__(self) -> None:
        if not (len(self.train_s) == len(self.tokens) == len(self.val_loss)):
            raise ValueError("a curve needs as many times and token counts as losses")


def crossing(xs: list[float], losses: list[float], target: float) -> float | None:
    """The first x where the piecewise-linear curve (xs, losses) reaches ``target``, or None."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return xs[0]
            x0, x1, l0 = xs[i - 1], xs[i], losses[i - 1]
            return x0 + (x1 - x0) * (l0 - target) / (l0 - loss)
    return None


def time_to_target(curve: Curve, target: float) -> float | None:
    return crossing(curve.train_s, curve.val_loss, target)


def tokens_to_target(curve: Curve, target: float) -> float | None:
    return crossing([float(t) for t in curve.tokens], curve.val_loss, target)


def read_curve(run_dir: Path, rank: int = 0) -> Curve:
    """The validation points rank ``rank`` recorded (losses are already averaged over replicas)."""
    points = [r for r in read_metrics(Path(run_dir) / "metrics" / f"rank{rank}.jsonl") if "val_loss" in r]
    return Curve(
        [float(r["train_s"]) for r in points],
        [int(r["tokens"]) for r in points],
        [float(r["val_loss"]) for r in points],
    )
