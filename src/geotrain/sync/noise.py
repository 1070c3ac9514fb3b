"""The local steps' learning rate from the measured gradient noise (``--lr-scale auto``).

Why a local method needs it. Adam's step is its momentum over the root of its second moment v.
A worker of N sees its own gradient, over 1/N of the global batch: per coordinate its v holds
s^2 + sigma^2 (the signal squared plus the noise of one worker's batch), where DDP's averaged
gradient has s^2 + sigma^2 / N. The momenta average linearly, so the mean of the N workers'
steps is DDP's step times sqrt((s^2 + sigma^2 / N) / (s^2 + sigma^2)): the local methods
average smaller steps than DDP takes, by up to sqrt(N) where noise dominates, by nothing where
the signal does. Scaling each local step by the inverse, with rho = s^2 / (s^2 + sigma^2),

    scale = sqrt(N / (N rho + 1 - rho)),                in [1, sqrt(N)],

makes the mean step DDP's in both its signal and its noise. ``--lr-scale sqrt`` takes the
noise-dominated end (rho = 0) throughout; early in training the signal dominates and sqrt(N)
overshoots (docs/reaching-ddp-loss.md), which is what measuring rho avoids.

How rho is measured: across the workers, at the one point where their gradients are taken at the
same parameters. Right after a sync every replica holds the same model, so the gradients of the
next step differ only by their batches. Each worker keeps that step's gradient, divided by the
root of its Adam v (so each coordinate counts as Adam weighs it; ``record``), on a fixed random sample of
coordinates (``samples``, the same everywhere); at the next sync, before the average, one sum
all-reduce of the samples and their squared norms gives B = mean_i |g_i|^2 = |G|^2 + S and
A = |mean_i g_i|^2 = |G|^2 + S / N, so S = (B - A) N / (N - 1) and |G|^2 = (N A - B) / (N - 1),
each smoothed over the last syncs by its own moving average (the ratio of the averages, as
McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", advise for the gradient
noise scale, whose ratio this is). Consecutive steps of one worker cannot stand in for that:
Adam's steps oscillate in the sharp directions, and its consecutive gradients anti-correlate
(measured here: |G|^2 came out negative on ``tiny`` from the first steps).

Where it is measured (``SyncAlgorithm.measures_noise``): ``localsgd``, ``diloco``, ``co2`` and
``sparseloco`` at their syncs; ``dreamddp`` from a period's first step to its end, where each
layer was averaged within the last period rather than all at once, and ``sparseloco`` under
overlap, whose replicas differ by a period's late message: there the measure includes the
replicas' small differences too, and leans towards sqrt(N). ``streaming`` (fragments at staggered
steps), ``demo`` (one shared update) and the per-step methods keep the factor at 1.

It costs one all-reduce of ``samples`` + 2 half-precision floats per sync (4 KB by default),
counted in the step's bytes. After a regroup the members take the largest of each moving
average (``agree``), so a measure that a failure cut short on some of them leaves no two
different. Optimizers without a second moment (SGD) average their local steps linearly, as DDP
does: their scale stays 1. A hostile worker could move the estimate, not further than the
bounds: the factor stays in [1, sqrt(N)], and a non-finite sum is ignored.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SAMPLES = 2048  # coordinates sampled from the whole model
DECAY = 0.8  # the moving averages' decay, per sync: about the last 5 syncs
MIN_MEASURES = 2  # syncs measured before the scale leaves 1


def _sample(total: int, samples: int, seed: int) -> torch.Tensor:
    """``samples`` distinct indices in [0, total), sorted, the same for a seed; without a
    permutation of all ``total`` (8 bytes a parameter) where they are few among many."""
    gen = torch.Generator().manual_seed(seed)
    if total <= 4 * samples:
        return torch.randperm(total, generator=gen)[:samples].sort().values
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < samples:  # collisions are rare: one or two draws
        picked = torch.cat([picked, torch.randint(total, (2 * samples,), generator=gen)]).unique()
    keep = torch.randperm(picked.numel(), generator=gen)[:samples]
    return picked[keep].sort().values


class NoiseScale:
    """Measures rho across the workers (``record`` after the backward of a period's first step,
    ``exchange`` at its sync) and gives the factor a local step's learning rate is multiplied
    by (``factor``)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        samples: int = SAMPLES,
        decay: float = DECAY,
        seed: int = 0,
    ) -> None:
        if samples < 1:
            raise ValueError(f"samples must be >= 1 (coordinates to measure the noise on), got {samples}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1) (a moving average's decay), got {decay}")
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer
        self._beta2 = {  # each parameter's group's, looked up once
            id(q): float(group.get("betas", (0.9, 0.999))[1])
            for group in optimizer.param_groups
            for q in group["params"]
        }
        self.decay = decay
        sizes = [p.numel() for p in self.params]
        total = sum(sizes)
        picked = _sample(total, samples, seed)  # the same coordinates on every worker
        self.samples = picked.numel()
        self.index: list[tuple[int, torch.Tensor]] = []  # (parameter, flat indices into it)
        start = 0
        for i, n in enumerate(sizes):
            lo, hi = torch.searchsorted(picked, torch.tensor([start, start + n])).tolist()
            if hi > lo:
                self.index.append((i, picked[lo:hi] - start))
            start += n
        self.pending: torch.Tensor | None = None  # this period's first gradient, sampled
        self.g2 = 0.0  # moving average of |G|^2 (normalised), not debiased (the ratio needs not)
        self.noise = 0.0  # moving average of S
        self.measures = 0  # syncs measured

    def _second_moment(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, float, float] | None:
        """Adam's v of ``p``, its beta2 and its bias correction 1 - beta2^t, where the optimizer
        keeps them. The correction matters between workers: a joiner's fresh optimizer has a
        young v, which uncorrected would make its samples up to 1 / sqrt(1 - beta2) larger."""
        state = self.optimizer.state.get(p, {})
        v = state.get("exp_avg_sq")
        if not isinstance(v, torch.Tensor) or v.shape != p.shape:
            return None
        beta2 = self._beta2[id(p)]
        return v, beta2, 1.0 - beta2 ** float(state.get("step", 1))

    def record(self) -> None:
        """After the backward of a step taken from the replicas' common parameters (the first
        after a sync), before any average: keep this worker's sampled, normalised gradient.

        Normalised by the root of v as this step will update it (beta2 v + (1 - beta2) g^2),
        so |g| / sqrt(v) <= 1 / sqrt(1 - beta2) on every coordinate: a coordinate seen for the
        first time (an embedding row's first token) cannot blow the sums up."""
        picked = []
        for i, idx in self.index:
            p = self.params[i]
            moment = self._second_moment(p)
            if moment is None:  # no step taken yet (Adam's v is made at the first)
                self.pending = None
                return
            v, beta2, correction = moment
            # A parameter this step did not use has no gradient: zeros, on every worker alike
            # (on the parameter's device, as the others' samples).
            if p.grad is None:
                g = p.new_zeros(idx.numel(), dtype=torch.float32)
            else:
                g = p.grad.detach().reshape(-1)[idx].float()
            v_now = v.detach().reshape(-1)[idx].float().mul(beta2).add_(g.square(), alpha=1 - beta2)
            v_now.div_(correction + (1 - beta2) * (1 - correction))  # this step's 1 - beta2^(t+1)
            picked.append(torch.where(v_now > 0, g / v_now.sqrt(), torch.zeros_like(g)))
        self.pending = torch.cat(picked)

    def exchange(self, comm: Any) -> None:
        """At the sync, before its average, on every member of the group alike (a worker with
        nothing recorded, a joiner say, adds zeros and weighs 0): one sum all-reduce, then the
        moving averages of |G|^2 and S."""
        if comm.world_size < 2:
            self.pending = None
            return
        # In half precision: every value is at most 1 / sqrt(1 - beta2) (``record``), the
        # squared norm is sent per coordinate, and the weight is exact. On the CPU on every
        # worker, whatever the model's device (a few KB, read back as Python floats below).
        message = torch.zeros(self.samples + 2, dtype=torch.float16)
        if self.pending is not None:
            pending = self.pending.to(message.device)  # the model's device, or a snapshot's CPU
            message[: self.samples] = pending
            message[-2] = pending.square().mean()
            message[-1] = 1.0
        comm.all_reduce(message, op="sum")  # a sum: the norm check judges averages only
        self.pending = None
        total = message.float()
        n = float(total[-1])
        if not math.isfinite(float(total.sum())) or n < 2:
            return
        big = float(total[-2]) * self.samples / n  # B = mean_i |g_i|^2
        mean = float((total[: self.samples] / n).square().sum())  # A = |mean_i g_i|^2
        g2 = (n * mean - big) / (n - 1)
        noise = (big - mean) * n / (n - 1)
        self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
        self.noise = self.decay * self.noise + (1 - self.decay) * noise
        self.measures += 1

    def agree(self, comm: Any) -> None:
        """After a regroup, on every member: the state of the member that measured most (the
        first of them), whole, so that all hold the same again (an exchange a failure cut short
        may have landed on some members only; a joiner has the leader's)."""
        states = comm.all_gather_object(self.state_dict())
        self.load_state_dict(max(states, key=lambda s: s["measures"]))

    def signal_fraction(self) -> float | None:
        """rho = |G|^2 / (|G|^2 + S), in [0, 1]; None before MIN_MEASURES syncs were measured."""
        if self.measures < MIN_MEASURES:
            return None
        g2, noise = max(self.g2, 0.0), max(self.noise, 0.0)
        return 1.0 if g2 + noise == 0 else g2 / (g2 + noise)

    def factor(self, workers: int) -> float:
        """sqrt(N / (N rho + 1 - rho)): what a local step's learning rate is multiplied by among
        ``workers``; 1 before the estimate is made, or for a group of one."""
        rho = self.signal_fraction()
        if rho is None or workers <= 1:
            return 1.0
        return math.sqrt(workers / (workers * rho + 1.0 - rho))

    def state_dict(self) -> dict[str, Any]:
        """The moving averages, equal on every worker (each made from the same sums); not
        ``pending``, this worker's own sample (``SyncAlgorithm.state_dict`` keeps it apart)."""
        return {"g2": self.g2, "noise": self.noise, "measures": self.measures}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g2, self.noise, self.measures = float(state["g2"]), float(state["noise"]), int(state["measures"])
