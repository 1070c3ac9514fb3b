"""``ssgd``: synchronous data parallel SGD with bucketed gradient all-reduce overlapped with backward.

With ``compress`` (``--compress int8``, ``acpsgd:rank=4``, ...), each bucket's mean is taken by
that codec, launched from the same hook, so compression keeps bucketing and overlap. A codec of
two phases (int8's all-to-all, then the all-gather of the re-quantised shards) sends the second
under backward too: before a bucket is launched, the one launched ``ADVANCE_DEPTH`` launches
earlier is advanced, as DreamDDP does its layers (``plan.cost.codec_exposed``).

Each parameter's post-accumulate-grad hook marks it ready; when every parameter of a bucket
(buckets of ``bucket_mb`` in backward order) is ready, the bucket's gradients are flattened and
their mean all-reduce is launched asynchronously, so it runs while backward continues on the
earlier layers. ``before_step`` waits for all buckets and writes the mean gradients back, so the
optimizer step is the same on every worker and replicas stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geotrain.comm.buckets import DEFAULT_BUCKET_MB, advance_behind, make_buckets, mean_async, wait_all
from geotrain.plan.cost import ADVANCE_DEPTH
from geotrain.sync.base import SyncAlgorithm, SyncConfig, require


@dataclass
class SSGDConfig(SyncConfig):
    bucket_mb: float = DEFAULT_BUCKET_MB
    compress: str = ""  # a codec spec (geotrain.compress); "": uncompressed

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"bucket_mb must be > 0 (a size in MB), got {self.bucket_mb}")


class SSGD(SyncAlgorithm):
    name = "ssgd"

    def __init__(self, model, optimizer, comm, config: SSGDConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or SSGDConfig())
        # Reverse registration order approximates the order backward produces gradients.
        self._params = list(reversed(self.parameters()))
        self._buckets = make_buckets(self._params, self.config.bucket_mb)
        self._bucket_of = {}
        for b, idx in enumerate(self._buckets):
            for i in idx:
                self._bucket_of[id(self._params[i])] = b
        self._ready = [0] * len(self._buckets)
        self._launched: list = [None] * len(self._buckets)
        self._order: list[int] = []  # buckets in the order launched this step
        self._hooks = []
        if comm.world_size > 1:
            for p in self._params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.comm.world_size == 1:  # a group shrunk to this worker: nothing to average
            return
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        if self._ready[b] == len(self._buckets[b]):
            self._launch(b)

    def _grads(self, b: int) -> list[torch.Tensor]:
        grads = []
        for i in self._buckets[b]:
            p = self._params[i]
            if p.grad is None:  # unused in this step's graph: contributes zero, as in DDP
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def _launch(self, b: int) -> None:
        # Every worker launches its buckets in one order as long as their backward graphs are
        # the same (a parameter unused on one worker only would pair different buckets).
        grads = self._grads(b)
        if self.codec is not None:
            advance_behind(self._order, ADVANCE_DEPTH, self._launched.__getitem__)
            self._launched[b] = self.codec.reduce(self.comm, ("grad", b), grads)
        else:
            self._launched[b] = mean_async(self.comm, grads)
        self._order.append(b)

    def before_step(self) -> None:
        if self.comm.world_size == 1:
            return
        # Launch in bucket order any bucket that backward did not complete, so all workers issue
        # the same collectives in the same order.
        for b in range(len(self._buckets)):
            if self._launched[b] is None:
                self._launch(b)
        # Each mean written into its bucket's gradients; a codec's remaining second phases
        # advanced the last launched first, as the cost model prices them (``codec_exposed``)
        wait_all([self._launched[b] for b in reversed(self._order)])
        self._reset()
        self.syncs += 1

    def _reset(self) -> None:
        self._ready = [0] * len(self._buckets)
        self._launched = [None] * len(self._buckets)
        self._order = []

    def rebind(self) -> None:
        self._reset()  # the failed step is redone from its backward: nothing of it is kept

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def after_step(self) -> bool:
        super().after_step()
        return self.comm.world_size > 1  # gradients were averaged this step

    def replicated_parts(self) -> set[str]:
        # Equal parameters, equal averaged gradients, the same optimizer step: all equal.
        return {"model", "optimizer", "sync"} if self.comm.world_size > 1 else {"sync"}
