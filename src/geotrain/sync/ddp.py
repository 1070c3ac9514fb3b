"""``ddp``: PyTorch ``DistributedDataParallel`` itself, the reference users run today.

Bytes are accounted from the gradient sizes (DDP all-reduces every gradient every step); the time
DDP waits for its all-reduces happens inside ``backward`` and cannot be told apart from compute,
so this algorithm reports no blocked-communication time.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel

from geotrain.sync.base import SyncAlgorithm, SyncConfig, require


@dataclass
class DDPConfig(SyncConfig):
    bucket_mb: float = 25.0  # DDP's own default

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"bucket_mb must be > 0 (a size in MB), got {self.bucket_mb}")


class DDP(SyncAlgorithm):
    name = "ddp"
    measures_blocked_time = False

    def __init__(self, model, optimizer, comm, config: DDPConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or DDPConfig())
        self._ddp = None
        if comm.world_size > 1:
            # DDP broadcasts parameters itself; ours (in super) already made them equal.
            self._ddp = DistributedDataParallel(
                model, process_group=comm.group, bucket_cap_mb=self.config.bucket_mb
            )
        self._grad_tensors = [p for p in self.parameters()]

    def broadcast_parameters(self) -> None:
        pass  # DistributedDataParallel's constructor does it

    @property
    def model(self):
        return self._ddp if self._ddp is not None else self.module

    def before_step(self) -> None:
        if self.comm.world_size > 1:
            self.comm.account_external(self._grad_tensors)
            self.syncs += 1

    def after_step(self) -> bool:
        super().after_step()
        return self.comm.world_size > 1  # gradients were averaged this step
