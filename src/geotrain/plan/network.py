"""All-reduce cost at scales this machine cannot run: ring and tree, per-host bandwidth, uneven links.

A profile measures ``alpha + beta * bytes`` for one all-reduce on N_p workers. This module
splits that into per-hop latency and link efficiency, then predicts for N workers on other links:

- ring (bandwidth-optimal): 2 (N-1) steps, each moving bytes/N over every link at once, so it runs
  at the slowest host's rate:   T = 2 (N-1) a + 2 (N-1)/N * bytes / (e * B_min);
- tree (latency-optimal; a pipelined double binary tree as NCCL uses):
  T = 2 ceil(log2 N) a + 2 * bytes / (e * B_min)  (each byte goes up and down once per link);

and takes the faster of the two, as NCCL's tuner does. ``a`` (per-hop latency) and ``e`` (the
fraction of the nominal rate a transfer achieves) come from the profile:
a = alpha / (2 (N_p - 1)),  e = 2 (N_p-1)/N_p / (beta * B_p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from geotrain.plan.cost import LinkModel


@dataclass(frozen=True)
class NetworkModel:
    hop_latency_s: float
    efficiency: float  # achieved fraction of the nominal link rate

    def __post_init__(self) -> None:
        if self.hop_latency_s < 0 or not 0 < self.efficiency <= 1.5:
            raise ValueError(f"bad network model: latency {self.hop_latency_s}, efficiency {self.efficiency}")

    @classmethod
    def calibrate(cls, link: LinkModel, workers: int, rates_bps: list[int]) -> NetworkModel:
        """From a profile's fit on ``workers`` hosts whose links run at ``rates_bps``."""
        if workers < 2:
            raise ValueError("a network model needs a profile taken on at least 2 workers")
        b_min = min(rates_bps) / 8  # bytes per second
        hop = link.alpha_s / (2 * (workers - 1))
        efficiency = (
            (2 * (workers - 1) / workers) / (link.beta_s_per_byte * b_min) if link.beta_s_per_byte else 1.0
        )
        return cls(hop, min(efficiency, 1.5))

    def ring_s(self, nbytes: float, workers: int, rates_bps: list[int]) -> float:
        if workers < 2 or nbytes <= 0:
            return 0.0
        b = self.efficiency * min(rates_bps) / 8
        return 2 * (workers - 1) * self.hop_latency_s + 2 * (workers - 1) / workers * nbytes / b

    def tree_s(self, nbytes: float, workers: int, rates_bps: list[int]) -> float:
        if workers < 2 or nbytes <= 0:
            return 0.0
        b = self.efficiency * min(rates_bps) / 8
        return 2 * math.ceil(math.log2(workers)) * self.hop_latency_s + 2 * nbytes / b

    def link_model(self, workers: int, rates_bps: list[int], algorithm: str = "best") -> LinkModel:
        """The ``alpha + beta * bytes`` line for ``workers`` hosts (ring, tree, or the faster per size
        evaluated at 1 MB, where the choice between them matters for gradient buckets)."""
        if algorithm not in ("ring", "tree", "best"):
            raise ValueError(f"all-reduce algorithm must be ring, tree or best, got {algorithm!r}")
        if workers < 2:
            return LinkModel(0.0, 0.0)
        b = self.efficiency * min(rates_bps) / 8
        ring = LinkModel(2 * (workers - 1) * self.hop_latency_s, 2 * (workers - 1) / workers / b)
        tree = LinkModel(2 * math.ceil(math.log2(workers)) * self.hop_latency_s, 2 / b)
        if algorithm == "ring":
            return ring
        if algorithm == "tree":
            return tree
        return ring if ring.time(2**20) <= tree.time(2**20) else tree


# The largest single transfer a worker waits on: a joiner's hand-over carries the model and
# AdamW's two moments, three fp32 copies, down one link (an all-reduce of the model moves two).
STATE_COPIES = 3
MIN_COLLECTIVE_TIMEOUT_S = 600.0
# Where the link's rate is not known (a run on real machines without --link-rate): the slowest
# the library is built for, so a large model's hand-over is not cut at the floor
UNKNOWN_LINK_BPS = 10e6


def collective_timeout_s(
    model_bytes: int, link_bps: float, floor_s: float = MIN_COLLECTIVE_TIMEOUT_S
) -> float:
    """The process groups' timeout when none is given: twice the time the slowest link
    (``link_bps``; 0 when unknown or unshaped, taken as ``UNKNOWN_LINK_BPS``) needs for
    ``STATE_COPIES`` copies of the model, plus a minute, and never under ``floor_s``. At 350
    kbit/s that is 1.7 hours for GPT ``mini`` (43.6 MB), where 600 s ended a run in the middle of
    its first outer step; at an unknown rate, the floor up to about 300M parameters, and 5.3
    hours for 1B (whose hand-over at 10 Mbit/s takes about 55 minutes).

    A long timeout does not slow failure detection: a lost or frozen peer is found by its
    heartbeat (``--fault-timeout``), not by a collective's timeout."""
    link_bps = link_bps if link_bps > 0 else UNKNOWN_LINK_BPS
    return max(floor_s, round(2 * STATE_COPIES * model_bytes * 8 / link_bps + 60))
