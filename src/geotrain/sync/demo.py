"""``demo``: DeMo, Decoupled Momentum optimisation (Peng, Quesnelle, Kingma, arXiv 2411.19870).

No periodic averaging: every step, each worker

    m    <- beta * m + g                          (a local momentum of its own gradient g)
    c     = TopK_chunk(DCT(m))                    (k coefficients per block of the DCT of m)
    m    <- m - IDCT(c)                           (what is sent leaves the momentum)
    u     = sign(IDCT(mean over workers of c))    (all-gathered, decoded, averaged)
    theta <- theta * (1 - lr * wd) - lr * u       (signed SGD with decoupled weight decay)

Every worker decodes the same gathered bytes, so every replica applies the same update and the
replicas stay bitwise equal; the momenta are each worker's own.

The DCT is the orthonormal DCT-II, applied per block by matrix products: a 2-d parameter of shape
(n1, n2) is cut into blocks of (b1, b2), b the largest divisor of n not above ``chunk`` (the
reference code's ``get_smaller_split``), each block transformed along both dimensions; 1-d ones
(and the flattened rows of others) into blocks of b along their length. Each block's ``k``
largest coefficients travel through ``geotrain.compress.chunked.ChunkTopK`` (one chunk per block,
values in ``bits`` bits, indices packed): one all-gather per step of all parameters' messages.

Defaults of the reference code: chunk 64 per dimension (blocks of 64 x 64 = 4096 coefficients),
k=32, momentum decay beta=0.999; its values are sent in full precision, ours in 8 bits with a
scale per block (the update uses only the sign of the mean). The wrapped optimizer is not used
for the update (DeMo is the optimizer): its learning rate (and schedule) and weight decay are.
Unless ``--lr`` is given that learning rate is 2e-3, twice AdamW's default (``default_lr``): at
1e-3 DeMo ended 13% above DDP on GPT ``tiny``, at 2e-3 1.7% (3.0% with another seed).

``overlap`` (off by default) takes the all-gather off the critical path: the gather of step t's
messages runs under step t+1's forward and backward, and its signed step lands at step t+1 (one
step late, on every worker alike, so the replicas stay bitwise equal); ``finalize`` lands the
last one. Without it every step waits for its gather: at 350 kbit/s on W1 that was 0.09 of
``nosync``'s speed. It is off by default because the loss does not hold: a signed step moves every
entry by the full learning rate, and one step late it overshoots. On GPT ``tiny`` (4 workers, 400
steps) the final validation loss went from 1.961 to 2.305 at lr 2e-3 (seed 1: 2.262 to 2.737),
and to 2.244 at 1e-3 and 2.268 at 1.5e-3. A message in flight is training state: a snapshot
holds this worker's own, and a resumed or regrouped worker gathers it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from geotrain.compress.chunked import ChunkTopK, require_chunking
from geotrain.plan.gather import gather_warning
from geotrain.sync.base import InFlight, SyncAlgorithm, SyncConfig, own_value, require


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II basis: row k is ``sqrt(2/n) cos(pi (2j+1) k / 2n)`` (row 0 scaled by
    ``1/sqrt(2)``), so ``D @ x`` is ``scipy.fft.dct(x, norm="ortho")`` and ``D.T`` inverts it."""
    j = torch.arange(n, dtype=torch.float64)
    k = j.unsqueeze(1)
    d = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.float()


def block_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target``."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


class BlockDCT:
    """The DCT of one parameter in blocks; coefficients laid out block after block. Its bases are
    made on the CPU (the same bits on every device) and kept on ``device``, the parameter's."""

    def __init__(self, shape: tuple[int, ...], chunk: int, device: torch.device | str | None = None) -> None:
        self.shape = shape
        rows = shape[0] if len(shape) >= 2 else 1
        cols = math.prod(shape) // rows
        self.b1 = block_size(rows, chunk) if rows > 1 else 1
        self.b2 = block_size(cols, chunk)
        self.rows, self.cols = rows, cols
        self.d1, self.d2 = dct_matrix(self.b1).to(device), dct_matrix(self.b2).to(device)

    @property
    def block(self) -> int:
        return self.b1 * self.b2

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        a, c = self.rows // self.b1, self.cols // self.b2
        blocks = x.reshape(a, self.b1, c, self.b2)
        coeffs = torch.einsum("ij,ajck,lk->acil", self.d1, blocks, self.d2)
        return coeffs.reshape(-1)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        a, c = self.rows // self.b1, self.cols // self.b2
        blocks = coeffs.reshape(a, c, self.b1, self.b2)
        x = torch.einsum("ji,acjl,lk->aick", self.d1, blocks, self.d2)
        return x.reshape(self.shape)


@dataclass
class DeMoConfig(SyncConfig):
    # A signed step moves every entry by the full learning rate; measured on GPT ``tiny`` (4
    # workers, 400 steps, final validation loss against DDP at AdamW's 1e-3: 1.929 seed 0, 2.196
    # seed 1): 1e-3 2.184, 1.5e-3 2.022, 2e-3 1.961 (seed 1: 2.262), 2.5e-3 2.217, 4e-3 2.218.
    default_lr: ClassVar[float] = 2e-3
    # A 40-step warm-up took its 400 tiny steps from 1.961 to 2.052 (docs/frontier.md): auto gives none.
    auto_warmup: ClassVar[bool] = False
    chunk: int = 64
    k: int = 32
    bits: int = 8
    beta: float = 0.999
    overlap: bool = False

    def __post_init__(self) -> None:
        require_chunking(
            self.chunk, self.k, self.bits, lambda f: f"--{f}", "DCT block per dimension",
            self.chunk * self.chunk, "--chunk squared",
        )  # fmt: skip
        require(0 <= self.beta < 1, f"--beta (momentum decay) must be in [0, 1), got {self.beta}")


class DeMo(SyncAlgorithm):
    name = "demo"

    def __init__(self, model, optimizer, comm, config: DeMoConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or DeMoConfig())
        cfg = self.config
        self._params = self.parameters()
        self._transforms = [BlockDCT(tuple(p.shape), cfg.chunk, p.device) for p in self._params]
        self._codecs = [
            # Blocks of one coefficient (a one-value tensor, a 1-d tensor whose length has no
            # divisor up to --chunk): chunks of 2, the codec's least, both sent, as every
            # coefficient of a 1-blocks tensor was meant to be.
            ChunkTopK(chunk=max(2, t.block), k=min(cfg.k, max(2, t.block)), bits=cfg.bits)
            for t in self._transforms
        ]
        self._sizes = [c.payload_bytes(p.numel()) for c, p in zip(self._codecs, self._params, strict=True)]
        self._momentum = [torch.zeros_like(p, dtype=torch.float32) for p in self._params]
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.in_flight = InFlight(comm)  # this worker's message, landing a step late (overlap)

    def message_bytes(self) -> int:
        return sum(self._sizes)

    def before_step(self) -> None:
        momenta, payload = self._message()
        if not self.config.overlap:
            self._land_in_flight()  # none, unless a snapshot taken with overlap holds one
            gathered = self.comm.all_gather(payload)
            # Only once the gather arrived: a step redone after a failure starts from the same momenta.
            self._momentum = momenta
            self._apply(gathered)
        else:
            self._land_in_flight()  # the previous step's; if it fails, nothing here has changed
            self._momentum = momenta
            self.in_flight.launch(payload)
        for p in self._params:
            p.grad = None  # DeMo takes the step: the wrapped optimizer skips every parameter

    def _message(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The momenta after this step's gradient, less what is sent, and the packed message."""
        momenta, payloads = [], []
        for p, m, t, c in zip(self._params, self._momentum, self._transforms, self._codecs, strict=True):
            g = p.grad.detach().float() if p.grad is not None else torch.zeros_like(m)
            new = m * self.config.beta + g
            coefficients = t.encode(new)
            payload, sent = c.encode(coefficients)
            spoiled = self.comm.spoiled(coefficients)  # --chaos corrupt: the message, not the momentum
            if spoiled is not None:
                payload = c.encode(spoiled)[0]
            momenta.append(new.sub_(t.decode(sent)))
            payloads.append(payload)
        return momenta, torch.cat(payloads)

    def _apply(self, gathered: torch.Tensor) -> None:
        """theta <- theta (1 - lr wd) - lr sign(IDCT(mean of the gathered messages))."""
        weights = self._weights(gathered) if self.comm.checking else None
        offset = 0
        with torch.no_grad():
            for p, t, c, size in zip(self._params, self._transforms, self._codecs, self._sizes, strict=True):
                mean = c.mean_of(gathered[:, offset : offset + size], p.numel(), weights)
                offset += size
                group = self._group_of[id(p)]
                lr, wd = group["lr"], group.get("weight_decay", 0.0)
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(t.decode(mean).sign_().to(p.dtype), alpha=-lr)

    def _weights(self, gathered: torch.Tensor) -> list[float]:
        """The norm check over each worker's whole message (every parameter's coefficients;
        the DCT is orthonormal, so it is the norm of what the message stands for): one verdict
        per worker and step, the same on every worker, with no communication."""
        squares = [0.0] * gathered.shape[0]
        finite = [True] * gathered.shape[0]
        offset = 0
        for p, c, size in zip(self._params, self._codecs, self._sizes, strict=True):
            for r, (norm, ok) in enumerate(c.norms(gathered[:, offset : offset + size], p.numel())):
                squares[r] += norm * norm
                finite[r] = finite[r] and ok
            offset += size
        return self.comm.weigh_gathered([(math.sqrt(s), ok) for s, ok in zip(squares, finite, strict=True)])

    def _land_in_flight(self) -> None:
        gathered = self.in_flight.land()
        if gathered is not None:
            self._apply(gathered)

    def finalize(self) -> None:
        self._land_in_flight()

    def close(self) -> None:
        self.in_flight.close()

    def rebind(self) -> None:
        self.in_flight.rebind()

    def default_snapshot_every(self) -> int:
        return 50

    def replicated_parts(self) -> set[str]:
        return {"model"}  # the momenta in the algorithm's state are each worker's own

    def info(self) -> str:
        n = sum(p.numel() for p in self._params)
        warning = gather_warning(self.message_bytes(), n, self.comm.world_size)
        return (
            f"{self.config.k} DCT coefficients per block of {self.config.chunk}x{self.config.chunk}, "
            f"{self.config.bits}-bit: {self.message_bytes()} bytes per worker per step "
            f"({100 * self.message_bytes() / (4 * n):.2f}% of fp32){'; ' + warning if warning else ''}"
        )

    def adopted_state(self) -> None:
        # Another worker's momenta and message in flight are its own. That message's gather is
        # still to be made by every member: this worker takes part with an empty message.
        for m in self._momentum:
            m.zero_()
        self.in_flight.adopted()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # this worker's alone ("own"): in its snapshots, never handed to an adopter (who would
        # zero it: ``adopted_state``)
        state["own"] = {**state.get("own", {}), "momentum": list(self._momentum)}
        # This worker's own message in flight (overlap): a resumed run gathers it again first, so
        # N + stop + N lands the same update at the same step as 2N.
        state["in_flight"] = self.in_flight.saved()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        momentum = own_value(state, "momentum")
        if momentum is None:
            momentum = [torch.zeros_like(m) for m in self._momentum]
        for dst, src in zip(self._momentum, momentum, strict=True):
            dst.copy_(src)
        self.in_flight.restore(state.get("in_flight"), self.device)
