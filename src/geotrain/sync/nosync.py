"""``nosync``: every worker trains alone, nothing crosses the network.

The compute-only bound: every benchmark reports step times as a ratio to this.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.sync.base import SyncAlgorithm, SyncConfig


@dataclass
class NoSyncConfig(SyncConfig):
    pass


class NoSync(SyncAlgorithm):
    name = "nosync"

    def broadcast_parameters(self) -> None:
        # Same seed, same initial parameters; a broadcast would be the run's only traffic.
        pass
