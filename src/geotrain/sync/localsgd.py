"""``localsgd``: H local optimizer steps, then the replicas' parameters are averaged.

Local SGD (Stich 2019; Lin et al. 2020) trades communication frequency for replica drift: with
period ``H`` it moves 1/H of synchronous SGD's bytes, but each sync is a whole-model all-reduce
that nothing overlaps. With H=1 and plain SGD it equals synchronous SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.comm.buckets import DEFAULT_BUCKET_MB, reduce_tensors
from geotrain.sync.base import SyncAlgorithm, SyncConfig, require


@dataclass
class LocalSGDConfig(SyncConfig):
    H: int = 10
    bucket_mb: float = DEFAULT_BUCKET_MB

    def __post_init__(self) -> None:
        require(
            isinstance(self.H, int) and self.H >= 1,
            f"H (steps between syncs) must be an integer >= 1, got {self.H}",
        )
        require(self.bucket_mb > 0, f"bucket_mb must be > 0 (a size in MB), got {self.bucket_mb}")


class LocalSGD(SyncAlgorithm):
    name = "localsgd"

    def __init__(self, model, optimizer, comm, config: LocalSGDConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or LocalSGDConfig())

    def average_parameters(self) -> None:
        reduce_tensors(self.comm, [p.data for p in self.parameters()], self.config.bucket_mb)
        self.syncs += 1

    def after_step(self) -> bool:
        super().after_step()
        if self.step_count % self.config.H == 0:
            self.average_parameters()
            return True
        return False

    def finalize(self) -> None:
        if self.step_count % self.config.H:
            self.average_parameters()
