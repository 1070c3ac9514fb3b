"""``diloco``: DiLoCo (Douillard et al., arXiv 2311.08105).

Each worker takes ``H`` inner steps with its own optimizer (AdamW in the paper). Then the outer
step: the pseudo-gradient Delta = theta_outer - mean_k(theta_k) is all-reduced (as the mean of
each worker's theta_outer - theta_k, same bytes) and an outer Nesterov SGD step with learning
rate ``outer_lr`` (0.7; 1 at H <= 2, below) and momentum ``outer_momentum`` updates
theta_outer, which every worker then copies into its model. With ``outer_lr=1`` and no
momentum, theta_outer becomes the mean of the replicas: Local SGD.

The paper's momentum, 0.9, was tuned at H=500. In a steady state the momentum multiplies each
outer step by 1 / (1 - momentum): 0.7 x 10 = 7 times the mean local progress of a period. At
small H that overshoots: on ``mini`` with H=10 (4 workers, 150 steps) 0.9 sat on the early
plateau for 90 steps and ended 15% above DDP's loss, 0.5 ended 3.9% above it
(docs/reaching-ddp-loss.md). So unless set, the momentum follows H (``outer_momentum_for``): the
outer step's multiple of the local progress, outer_lr / (1 - momentum), grows from 1.4 at H=10
to the paper's 7 at H=500, log-linearly in H, and the momentum is what gives that multiple at
the configured ``outer_lr``. Up to H=2 the multiple is 1 and, unless an outer lr is given, the
outer step is the plain average (``outer_lr`` 1, no momentum: Local SGD's): on W1 (``mini``,
4 workers, batch 8 x 128, int4, H=2) the multiple of 1.4 scored 1.7152 at step 400, 5.5%
above DDP's 1.5884 and above H=10's 1.7006, where the plain average scored 1.6381
(docs/reaching-ddp-loss.md). A period of two steps is two of each worker's AdamW steps, whose own
momentum already carries the direction; a momentum on top of them overshoots.

With ``momentum_ramp`` N > 0 (off by default) that value is where the momentum starts: where it
follows H, it then rises linearly to the paper's 0.9 over the first N outer steps and stays
there. The low start keeps the first outer steps, when the model changes fastest, from
overshooting; the paper's 0.9 pays once the pseudo-gradients agree from one period to the next.
On GPT ``tiny`` (4 workers, loopback, 2,000 steps, final validation loss; DDP 1.4820 / 1.6762 at
seeds 0 / 1): H=20 from 1.5097 / 1.7177 with the H value throughout to 1.4322 / 1.5989 with a
ramp of 10 (0.9 throughout: 1.4836 / 1.6681; a ramp over 25 outer steps 1.4268), H=10 from
1.5275 to 1.4350, H=50 from 1.4868 to 1.4730; at 400 steps, H=20, 2.0521 / 2.3036 to 2.0347 /
2.2893 (docs/reaching-ddp-loss.md). But on GPT ``mini`` (W1's batch, H=10) the ramp scored
worse at 150 steps (2.398 against 2.340) and at 400 (1.935 against 1.740): the larger model is
still in its steep start there, where 0.9 overshoots, and on W1 to 1,000 steps it ended 14% above
(1.4450 against 1.2627). So it is off by default (0: the H value throughout); 10 outer steps is
the length measured best on ``tiny``. A momentum given keeps it.

The pseudo-gradients travel in int4 by default (``compress``; as Streaming DiLoCo sends its
outer gradients), with error feedback: on W1 (``mini``, 4 workers) over 2,000 steps at H=10 int4
scored as fp32 did (below it at 25 of 31 evaluations from step 450, 0.58% on their mean; final
1.0514 against 1.0526) and ran at 0.90 of nosync's step at 100 Mbit/s and 0.77 at 20 Mbit/s,
where fp32 ran at 0.74 and 0.37. ``compress="none"`` sends fp32.

Memory: one extra copy of the parameters (theta_outer) plus the outer momentum buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from geotrain.comm.buckets import DEFAULT_BUCKET_MB, reduce_tensors
from geotrain.compress import DEFAULT_CODECS, plain_spec
from geotrain.sync.base import (
    PeriodicSync,
    SyncConfig,
    codec_from_config,
    require,
    require_pace,
    require_period,
    require_site_period,
    require_warm_start,
)
from geotrain.sync.periods import check_schedule

# The outer step's multiple of a period's mean local progress, outer_lr / (1 - momentum): the
# paper's 0.7 / 0.1 = 7 at H=500, and 1.4 at H=10 where it was measured best here.
MULTIPLE_AT = ((10, 1.4), (500, 7.0))
# Up to this period the multiple is 1, and by default the outer step is the plain average (outer
# lr 1, no momentum): at H=2 on W1 the multiple of 1.4 scored 4.5% worse at step 400 (module
# docstring).
PLAIN_AVERAGE_UP_TO_H = 2


# With --momentum-ramp, a momentum that follows H rises from outer_momentum_for(H) to the paper's
# RAMP_TO (the module docstring's measurements).
RAMP_TO = 0.9


def ramped_momentum(start: float, outer_steps: int, ramp: int) -> float:
    """The momentum of outer step ``outer_steps`` (0 for the first): linear from ``start`` to
    ``RAMP_TO`` over ``ramp`` outer steps (0: ``start`` throughout; one at RAMP_TO or above stays)."""
    if ramp <= 0 or start >= RAMP_TO:
        return start
    return start + (RAMP_TO - start) * min(1.0, outer_steps / ramp)


def require_momentum_ramp(ramp: int) -> None:
    require(
        isinstance(ramp, int) and ramp >= 0,
        f"--momentum-ramp (outer steps over which the outer momentum rises to {RAMP_TO}) must be an "
        f"integer >= 0 (0: no ramp), got {ramp}",
    )


def outer_momentum_for(H: int, outer_lr: float = 0.7) -> float:
    """The outer momentum that gives the multiple ``MULTIPLE_AT`` names for ``H`` (log-linear in
    H between its points, held beyond them; 1 up to ``PLAIN_AVERAGE_UP_TO_H``), in [0, 0.9], to
    two decimals."""
    (h0, m0), (h1, m1) = MULTIPLE_AT
    x = min(1.0, max(0.0, math.log(H / h0) / math.log(h1 / h0)))
    multiple = 1.0 if H <= PLAIN_AVERAGE_UP_TO_H else m0 * (m1 / m0) ** x
    return round(min(0.9, max(0.0, 1 - outer_lr / multiple)), 2)


def default_outer_lr(H: int) -> float:
    """The outer learning rate where none is given: 1 up to ``PLAIN_AVERAGE_UP_TO_H`` (with the
    momentum that follows H, 0 there: the plain average), else the paper's 0.7."""
    return 1.0 if H <= PLAIN_AVERAGE_UP_TO_H else 0.7


@dataclass
class DiLoCoConfig(SyncConfig):
    H: int = 10
    outer_lr: float | None = None  # None: follows H (default_outer_lr: 0.7, 1 at H <= 2)
    outer_momentum: float | None = None  # None: follows H (outer_momentum_for)
    # set where outer_momentum was None: under --H-schedule it follows the period in force
    momentum_follows_H: bool = field(default=False, init=False, repr=False)
    # where the momentum follows H: outer steps over which it rises to the paper's 0.9 (0: none)
    momentum_ramp: int = 0
    nesterov: bool = True
    bucket_mb: float = DEFAULT_BUCKET_MB
    # a codec spec (geotrain.compress); "" or "none": uncompressed; int4 by default (DEFAULT_CODECS)
    compress: str = DEFAULT_CODECS["diloco"]
    warm_start: int = 0  # synchronous steps first (PeriodicSync)
    H_schedule: str = ""  # shorter periods first, then H (sync.periods); "": H throughout
    pace: str = "steps"  # "time": a period lasts the fastest worker's H steps (sync.pace)
    site_H: int = 0  # > 0: parameters averaged inside each site every site_H steps (--hierarchy)

    def __post_init__(self) -> None:
        require_period(self.H)
        if self.outer_lr is None:
            self.outer_lr = default_outer_lr(self.H)
        require(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")
        if self.outer_momentum is None:
            self.momentum_follows_H = True
            self.outer_momentum = outer_momentum_for(self.H, self.outer_lr)
        require(0 <= self.outer_momentum < 1, f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        require_momentum_ramp(self.momentum_ramp)
        require(self.bucket_mb > 0, f"bucket_mb must be > 0 (a size in MB), got {self.bucket_mb}")
        require_warm_start(self.warm_start)
        require_pace(self.pace)
        require_site_period(self.site_H, self.H)
        check_schedule(self.H_schedule, self.H, self.pace, self.site_H)  # before any worker starts


class DiLoCo(PeriodicSync):
    name = "diloco"

    def __init__(self, model, optimizer, comm, config: DiLoCoConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or DiLoCoConfig())
        cfg = self.config
        self._outer = [p.detach().clone() for p in self.parameters()]
        self.outer_optimizer = torch.optim.SGD(
            self._outer,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.nesterov and cfg.outer_momentum > 0,
        )
        if self.codec is not None and comm.two_level is not None:
            self.notice(
                f"diloco sends {self.codec.spec().partition(':')[0]} across all the hosts at once "
                "(a codec's all-to-all is flat; only its gather, where sites are of equal size, goes in two "
                "levels); --compress none averages in fp32 over the two levels",
            )

    def outer_step(self) -> None:
        params = self.parameters()
        deltas = [outer - p.detach() for outer, p in zip(self._outer, params, strict=True)]
        weight = self.sync_weight()
        if weight != 1.0:  # --pace time: the mean weighted by the steps each worker computed
            torch._foreach_mul_(deltas, weight)
        reduce_tensors(self.comm, deltas, self.config.bucket_mb, codec=self.codec, key="outer")
        for outer, delta in zip(self._outer, deltas, strict=True):
            outer.grad = delta
        if self.config.momentum_follows_H:
            self.outer_optimizer.param_groups[0]["momentum"] = self.momentum_now()
        self.outer_optimizer.step()
        with torch.no_grad():
            for outer, p in zip(self._outer, params, strict=True):
                p.copy_(outer)
                outer.grad = None
        self.syncs += 1

    synchronize = outer_step

    @property
    def outer_steps(self) -> int:
        """Outer steps taken: the syncs less a warm start's synchronous steps (so a snapshot's
        step and sync counts give it, with nothing more saved)."""
        return self.syncs - min(self.step_count, self.warm_start)

    def momentum_now(self) -> float:
        """Where the momentum follows H: this outer step's, the H value (of the period that just
        ended, under --H-schedule) ramped by the outer steps taken."""
        cfg = self.config
        start = cfg.outer_momentum
        if self.periods.grows:
            start = outer_momentum_for(self.periods.period(self.step_count - 1), cfg.outer_lr)
        return ramped_momentum(start, self.outer_steps, cfg.momentum_ramp)

    def track_parameters(self) -> None:
        with torch.no_grad():
            for outer, p in zip(self._outer, self.parameters(), strict=True):
                outer.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        """Right after an outer step theta_outer *is* the model's parameters: it is not saved
        twice (a fifth of a snapshot), and ``load_state_dict`` takes it from the parameters."""
        state = super().state_dict()
        # Callers copy or serialise the list.
        state["outer_params"] = None if self.synced_now() else list(self._outer)
        state["outer_optimizer"] = self.outer_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load after the model's own state (the parameters may stand for theta_outer). A run
        goes on sending what it sent: one saved before int4 was the default (its config says "",
        fp32) keeps fp32, whatever this run's default."""
        saved = state.get("config", {}).get("compress")
        if saved is not None and plain_spec(saved) != plain_spec(self.config.compress):
            self.config.compress = plain_spec(saved)
            self.codec = codec_from_config(self.config)
        super().load_state_dict(state)
        if state["outer_params"] is None:
            self.track_parameters()
        else:
            self.last_sync = -1  # the parameters are not the average (a boundary's failed sync)
            with torch.no_grad():
                for dst, src in zip(self._outer, state["outer_params"], strict=True):
                    dst.copy_(src)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
