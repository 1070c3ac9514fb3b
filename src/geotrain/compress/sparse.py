"""Sparsifying codecs: send only the largest values, keep the rest for later.

- ``topk`` (Aji and Heafield 2017; Lin et al. 2018, with error feedback): each worker sends its
  ``ratio * n`` largest-magnitude values and their indices; the rest stays in its residual and is
  added to the next message. Sparse vectors from different workers have different supports, so
  they cannot be summed on the wire: values and indices are all-gathered (4 + 4 bytes per value
  sent, to N-1 peers) and every worker adds them up the same way.
- ``adatopk`` (FusionLLM, arXiv 2410.12707): the ratio is set per worker from its measured link
  speed, ``ratio_j = ratio * N * speed_j / sum(speed)``, so the slowest link sends the fewest
  values and every worker's upload takes about as long; ``ratio`` is the mean over workers.
  The speeds are measured once, at the first message, by each worker broadcasting a probe.
  It helps where a worker's *upload* is the bottleneck (asymmetric home links); on a link slow both
  ways the slow worker's bottleneck is downloading the others' values, which its own ratio does
  not shrink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from geotrain.comm.buckets import Pending, flatten, unflatten_into
from geotrain.comm.communicator import Communicator
from geotrain.comm.guard import message_norm
from geotrain.compress.codec import Codec, Shapes, drop_if_not_finite, numel, require


def _distinct_in(idx: torch.Tensor, n: int) -> bool:
    """Whether a received message's indices are distinct and inside ``[0, n)``."""
    return idx.numel() == 0 or bool(idx.min() >= 0 and idx.max() < n and idx.unique().numel() == idx.numel())


@dataclass
class TopK(Codec):
    name = "topk"
    summary = "largest ratio*n values + indices, all-gathered, error feedback"
    ratio: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            0 < self.ratio <= 1,
            f"{self.name}: ratio (fraction of values sent) must be in (0, 1], got {self.ratio}",
        )

    def ratios(self, comm: Communicator) -> list[float]:
        return [self.ratio] * comm.world_size

    @staticmethod
    def count(ratio: float, n: int) -> int:
        return min(n, max(1, math.ceil(ratio * n)))

    def select(self, v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest-magnitude entries of ``v``: (values, int32 indices)."""
        idx = v.abs().topk(k, sorted=False).indices
        return v[idx], idx.to(torch.int32)

    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        state = self.state(key)
        v = flatten(tensors).float()
        n = v.numel()
        if "residual" in state:
            v += state["residual"]
        counts = [self.count(r, n) for r in self.ratios(comm)]
        values, idx = self.select(v, counts[comm.rank])  # values is a copy
        v[idx.long()] = 0  # what was not sent stays for the next message
        state["residual"] = drop_if_not_finite(v, comm)
        # Values and indices travel as one int32 message: the bits of the fp32 values, then indices.
        spoiled = comm.spoiled(values)  # --chaos corrupt: the message, not the residual
        message = torch.cat([(values if spoiled is None else spoiled).view(torch.int32), idx])
        if len(set(counts)) == 1:
            handle = comm.all_gather(message, async_op=True)
        else:
            handle = comm.all_gather_uneven(message, [2 * c for c in counts], async_op=True)

        def finish() -> None:
            gathered = zip(handle.wait(), counts, strict=True)
            parts = [(part[:k].view(torch.float32), part[k:].long()) for part, k in gathered]
            weights = [1.0] * len(parts)
            if comm.screening:  # the norm check on the gathered messages (the same on every worker)
                # indices distinct and in range, or the norm of the values is not the message's
                weights = comm.weigh_gathered([message_norm(v, _distinct_in(i, n)) for v, i in parts])
                if not any(weights):  # nothing to average: each worker keeps its own
                    return
            total = torch.zeros(n, device=message.device)  # where the gathered values are
            for (v, idx), weight in zip(parts, weights, strict=True):
                if weight:
                    total.index_add_(0, idx, v if weight == 1 else v * weight)
            unflatten_into(total.div_(max(1, sum(w > 0 for w in weights))), tensors)

        return Pending(finish)

    def wire_bytes(
        self, shapes: Shapes, world_size: int, ratios: list[float] | None = None, rank: int = 0
    ) -> int:
        n = sum(numel(s) for s in shapes)
        ratio = ratios[rank] if ratios else self.ratio
        return (world_size - 1) * 8 * self.count(ratio, n)


@dataclass
class AdaTopK(TopK):
    name = "adatopk"
    summary = "topk with a per-worker ratio proportional to its measured link speed (mean = ratio)"
    probe_mb: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.probe_mb > 0, f"{self.name}: probe_mb must be > 0, got {self.probe_mb}")
        self.link_speeds: list[float] | None = None
        self._probed_in: tuple[int, int] | None = None  # (membership epoch, group size) probed in

    def ratios(self, comm: Communicator) -> list[float]:
        # Probed again in every membership epoch, by every member alike: a joiner holds no
        # speeds (probing alone, it would wait in a collective nobody else makes), and the
        # members' are of the group before. (Speeds set by hand are kept.)
        group = (getattr(comm.membership, "epoch", 0), comm.world_size)
        if self.link_speeds is None or self._probed_in not in (None, group):
            seconds = comm.probe_broadcast_s(int(self.probe_mb * 2**20))
            self.link_speeds = [1.0 / max(s, 1e-9) for s in seconds]
            self._probed_in = group
        return self.ratios_for(self.link_speeds)

    def info(self) -> str:
        if self.link_speeds is None:
            return ""
        fastest = max(self.link_speeds)
        ratios = self.ratios_for(self.link_speeds)
        pairs = zip(ratios, self.link_speeds, strict=True)
        return "per-worker ratio " + ", ".join(f"{r:.4g} (link {s / fastest:.2f}x fastest)" for r, s in pairs)

    def ratios_for(self, speeds: list[float]) -> list[float]:
        require(len(speeds) > 0 and all(s > 0 for s in speeds), f"link speeds must be > 0, got {speeds}")
        total = sum(speeds)
        return [min(1.0, self.ratio * len(speeds) * s / total) for s in speeds]
