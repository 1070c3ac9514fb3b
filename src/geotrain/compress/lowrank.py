"""Low-rank codecs: a matrix M (n x m) travels as factors of rank r, (n + m) r values.

``powersgd`` (Vogels et al., NeurIPS 2019), one power iteration per step with a warm start:

    P = M Q;  all-reduce P;  P <- orth(P);  Q = M^T P;  all-reduce Q;  M_hat = P Q^T

Two all-reduces per step, the second waiting on the first, as in PyTorch's DDP hook. The
factors are linear in M, so the all-reduce sums them directly; a rank-r M is reconstructed
exactly (P spans its columns, so P P^T M = M).

``acpsgd`` (ACP-SGD, Zhang et al., arXiv 2306.08881) alternates which factor is computed and
sent, one all-reduce per step, so messages can be bucketed and overlapped with backward like
plain gradients:

    even steps: Q <- orth(Q);  P = M Q;    all-reduce P;  M_hat = P Q^T
    odd steps:  P <- orth(P);  Q = M^T P;  all-reduce Q;  M_hat = P Q^T

The factor that is not sent is the one all workers already share (the previous step's
all-reduced one), so every worker reconstructs the same M_hat. Without error feedback it is exact
on a fixed rank-r M from the second step on (P then spans M's columns, Q its rows); error
feedback adds last step's residual, whose rows lie elsewhere, so it gets there gradually.

Both codecs keep error feedback (M <- M + e, e = M - M_hat; ``error_feedback=false`` turns it
off) and send vectors (biases, norms) and matrices too small to gain uncompressed, in the same
message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from geotrain.comm.buckets import Pending, flatten, unflatten_into
from geotrain.comm.communicator import Communicator
from geotrain.compress.codec import Codec, Shapes, drop_if_not_finite, numel, require, ring_bytes


def orthonormal(m: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``m``'s columns (reduced QR)."""
    return torch.linalg.qr(m, mode="reduced").Q


@dataclass
class _LowRank(Codec):
    shares_factors = True  # P and Q: means over the group, or the seeded start
    rank: int = 4
    min_compression: float = 2.0  # compress a matrix only if it shrinks at least this much
    seed: int = 0
    error_feedback: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.rank >= 1, f"{self.name}: rank must be an integer >= 1, got {self.rank}")
        require(
            self.min_compression >= 1,
            f"{self.name}: min_compression must be >= 1 (1: compress every matrix), "
            f"got {self.min_compression}",
        )

    def plan(self, shapes: Shapes) -> list[tuple[int, int, int] | None]:
        """Per tensor: (rows, cols, rank) if it is sent as factors, else None (sent as is)."""
        out: list[tuple[int, int, int] | None] = []
        for shape in shapes:
            if len(shape) < 2:
                out.append(None)
                continue
            n = shape[0]
            m = numel(shape) // n
            r = min(self.rank, n, m)
            out.append((n, m, r) if n * m >= self.min_compression * r * (n + m) else None)
        return out

    def _inputs(self, key: Any, tensors: list[torch.Tensor]):
        """Matrices with error feedback added, the uncompressed tensors, and this key's state."""
        state = self.state(key)
        layout = self.plan([tuple(t.shape) for t in tensors])
        mats: dict[int, torch.Tensor] = {}
        for i, (t, lay) in enumerate(zip(tensors, layout, strict=True)):
            if lay is None:
                continue
            # A copy: the caller may overwrite ``t`` before the message is finished.
            m = t.detach().reshape(lay[0], lay[1]).float().clone()
            if self.error_feedback and f"e{i}" in state:
                m += state[f"e{i}"]
            mats[i] = m
            if f"q{i}" not in state:
                # The same seed on every worker: the first Q must be shared. Drawn on the CPU
                # (the same numbers whatever the device), then moved to the matrices' device.
                gen = torch.Generator().manual_seed(self.seed * 100003 + i)
                state[f"q{i}"] = torch.randn(lay[1], lay[2], generator=gen).to(m.device)
        rest = [t for t, lay in zip(tensors, layout, strict=True) if lay is None]
        return state, mats, rest

    def _finish(self, comm: Communicator, state, tensors, mats, approx: dict[int, torch.Tensor]) -> None:
        for i, m in mats.items():
            if self.error_feedback:
                state[f"e{i}"] = drop_if_not_finite(m - approx[i], comm)
            tensors[i].copy_(approx[i].reshape(tensors[i].shape))

    def _message_bytes(self, shapes: Shapes, world_size: int, rows_per_rank) -> int:
        """Ring bytes of one step: ``rank * rows_per_rank(n, m)`` values per factored matrix, the
        rest as is."""
        values = 0
        for shape, lay in zip(shapes, self.plan(shapes), strict=True):
            values += numel(shape) if lay is None else lay[2] * rows_per_rank(lay[0], lay[1])
        return ring_bytes(4 * values, world_size)

    @staticmethod
    def _pack(factors: list[torch.Tensor], rest: list[torch.Tensor]) -> torch.Tensor:
        parts = [f.reshape(-1) for f in factors] + [t.detach().reshape(-1).float() for t in rest]
        return torch.cat(parts) if parts else torch.zeros(0)

    @staticmethod
    def _unpack(
        flat: torch.Tensor, factors: list[torch.Tensor], rest: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        out, offset = [], 0
        for f in factors:
            out.append(flat[offset : offset + f.numel()].reshape(f.shape))
            offset += f.numel()
        if rest:
            unflatten_into(flat[offset:], rest)
        return out


@dataclass
class PowerSGD(_LowRank):
    name = "powersgd"
    summary = "rank-r factors P then Q (two all-reduces), warm start, error feedback"

    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        state, mats, rest = self._inputs(key, tensors)
        ps = [mats[i] @ state[f"q{i}"] for i in mats]
        handle = comm.all_reduce(self._pack(ps, rest), op="mean", async_op=True)

        second: dict[str, Any] = {}  # P's mean orthonormalised and Q's all-reduce, from advance()

        def advance() -> None:
            ps_mean = [orthonormal(p) for p in self._unpack(handle.wait(), ps, rest)]
            qs = [mats[i].T @ p for i, p in zip(mats, ps_mean, strict=True)]
            second["ps"], second["qs"] = ps_mean, qs
            if qs:
                second["handle"] = comm.all_reduce(flatten(qs), op="mean", async_op=True)

        def finish() -> None:
            ps_mean, qs = second["ps"], second["qs"]
            if qs:
                qs = self._unpack(second["handle"].wait(), qs, [])
            approx = {}
            for i, p, q in zip(mats, ps_mean, qs, strict=True):
                state[f"q{i}"] = q  # warm start: next step's power iteration begins here
                approx[i] = p @ q.T
            self._finish(comm, state, tensors, mats, approx)

        return Pending(finish, advance)

    def wire_bytes(self, shapes: Shapes, world_size: int) -> int:
        return self._message_bytes(shapes, world_size, lambda n, m: n + m)

    def phase_bytes(self, shapes: Shapes, world_size: int) -> tuple[int, int]:
        """P (with the tensors sent as they are), then Q (launched by ``advance``)."""
        first = self._message_bytes(shapes, world_size, lambda n, m: n)
        return first, self.wire_bytes(shapes, world_size) - first


@dataclass
class ACPSGD(_LowRank):
    name = "acpsgd"
    summary = "alternating PowerSGD: P or Q per step, one all-reduce, overlaps like plain all-reduce"

    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        state, mats, rest = self._inputs(key, tensors)
        step = int(state.get("step", torch.tensor(0)))
        state["step"] = torch.tensor(step + 1)
        send_p = step % 2 == 0
        fixed, sent = {}, []
        for i, m in mats.items():
            if send_p:
                fixed[i] = orthonormal(state[f"q{i}"])
                sent.append(m @ fixed[i])
            else:
                fixed[i] = orthonormal(state[f"p{i}"])
                sent.append(m.T @ fixed[i])
        handle = comm.all_reduce(self._pack(sent, rest), op="mean", async_op=True)

        def finish() -> None:
            means = self._unpack(handle.wait(), sent, rest)
            approx = {}
            for i, mean in zip(mats, means, strict=True):
                if send_p:
                    state[f"p{i}"] = mean
                    approx[i] = mean @ fixed[i].T
                else:
                    state[f"q{i}"] = mean
                    approx[i] = fixed[i] @ mean.T
            self._finish(comm, state, tensors, mats, approx)

        return Pending(finish)

    def wire_bytes(self, shapes: Shapes, world_size: int, step: int = 0) -> int:
        """Bytes for the ``step``-th message of this stream (even: P, n r values; odd: Q, m r)."""
        return self._message_bytes(shapes, world_size, lambda n, m: n if step % 2 == 0 else m)

    def phase_bytes(self, shapes: Shapes, world_size: int) -> tuple[int, int]:
        """One all-reduce, P and Q in turn: their mean."""
        both = self.wire_bytes(shapes, world_size, 0) + self.wire_bytes(shapes, world_size, 1)
        return both // 2, 0
