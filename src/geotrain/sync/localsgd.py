"""``localsgd``: H local optimizer steps, then the replicas' parameters are averaged.

Local SGD (Stich 2019; Lin et al. 2020) trades communication frequency for replica drift: with
period ``H`` it moves 1/H of synchronous SGD's bytes, but each sync is a whole-model all-reduce
that nothing overlaps. With H=1 and plain SGD it equals synchronous SGD.

With ``compress``, what is averaged is each replica's change since the last sync, x_k - x_ref
(x_ref, the last average, is the same on every worker and kept as one extra copy of the model):
a small change compresses far better than the parameters themselves, and
x <- x_ref + mean_k(x_k - x_ref) is the same average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from geotrain.comm.buckets import DEFAULT_BUCKET_MB, reduce_tensors
from geotrain.sync.base import (
    PeriodicSync,
    SyncConfig,
    adopt_mean_change,
    require,
    require_pace,
    require_site_period,
    require_warm_start,
)
from geotrain.sync.periods import check_schedule


@dataclass
class LocalSGDConfig(SyncConfig):
    H: int = 10
    bucket_mb: float = DEFAULT_BUCKET_MB
    compress: str = ""  # a codec spec (geotrain.compress); "": uncompressed
    warm_start: int = 0  # synchronous steps first (PeriodicSync)
    H_schedule: str = ""  # shorter periods first, then H (sync.periods); "": H throughout
    pace: str = "steps"  # "time": a period lasts the fastest worker's H steps (sync.pace)
    site_H: int = 0  # > 0: parameters averaged inside each site every site_H steps (--hierarchy)

    def __post_init__(self) -> None:
        require(
            isinstance(self.H, int) and self.H >= 1,
            f"H (steps between syncs) must be an integer >= 1, got {self.H}",
        )
        require(self.bucket_mb > 0, f"bucket_mb must be > 0 (a size in MB), got {self.bucket_mb}")
        require_warm_start(self.warm_start)
        require_pace(self.pace)
        require_site_period(self.site_H, self.H)
        check_schedule(self.H_schedule, self.H, self.pace, self.site_H)  # before any worker starts


class LocalSGD(PeriodicSync):
    name = "localsgd"

    def __init__(self, model, optimizer, comm, config: LocalSGDConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or LocalSGDConfig())
        self._ref = [p.detach().clone() for p in self.parameters()] if self.codec else []

    def average_parameters(self) -> None:
        params = [p.data for p in self.parameters()]
        weight = self.sync_weight()  # --pace time: the mean weighted by the steps each computed
        if self.codec is None and weight == 1.0:
            reduce_tensors(self.comm, params, self.config.bucket_mb)
        elif self.codec is None:  # on a copy: a failed average leaves the parameters to retry
            weighted = torch._foreach_mul(params, weight)
            reduce_tensors(self.comm, weighted, self.config.bucket_mb)
            torch._foreach_copy_(params, weighted)
        else:
            deltas = [p - ref for p, ref in zip(params, self._ref, strict=True)]
            if weight != 1.0:
                torch._foreach_mul_(deltas, weight)
            reduce_tensors(self.comm, deltas, self.config.bucket_mb, codec=self.codec, key="delta")
            adopt_mean_change(params, self._ref, deltas)
        self.syncs += 1

    synchronize = average_parameters

    def track_parameters(self) -> None:
        if self.codec:  # the reference of the changes sent
            with torch.no_grad():
                for ref, p in zip(self._ref, self.parameters(), strict=True):
                    ref.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.codec:
            state["ref"] = list(self._ref)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.codec:
            with torch.no_grad():
                for dst, src in zip(self._ref, state["ref"], strict=True):
                    dst.copy_(src)
