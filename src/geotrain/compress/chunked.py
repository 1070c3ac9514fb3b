"""Chunked top-k with packed values and packed indices: SparseLoCo's message.

SparseLoCo (Sarfi, Therien, Lidin, Belilovsky, arXiv 2508.15706) sends, per outer step, the
top-k entries of each fixed-size chunk of its error-feedback buffer, each value quantised to a few
bits. Because every chunk sends exactly k entries, every worker's message has the same size for
the same tensor, so a plain all-gather carries it and every worker decodes the same bytes.

The wire format of one message over a flat vector of ``n`` values (``c = ceil(n / chunk)``
chunks, the last one padded with zeros that are never decoded):

- ``c`` fp32 scales (4 bytes each): the largest magnitude sent from the chunk;
- ``c * k`` value codes of ``bits`` bits, packed: a symmetric grid of ``2**bits`` levels from
  ``-scale`` to ``+scale`` without zero (a selected entry is never worth sending as zero);
- ``c * k`` indices inside the chunk, ``ceil(log2(chunk))`` bits each, packed (12 bits for the
  paper's chunk of 4096, not 32).

At the defaults (chunk 4096, k 64, 2 bits) that is 1.56% of the entries at 14 bits each plus a
scale per chunk: 0.71% of the fp32 bytes, 1/141 of a dense message.

As a codec, chunks are cut from the flattened tensors of one message, so a chunk may span the
end of one parameter and the start of the next. SparseLoCo lays its parameters out with
``TensorChunks`` first, each padded to a multiple of the chunk, so its chunks are per tensor as
the paper's are (on GPT ``mini`` 1.6% more chunks than the flat layout; on ``tiny``, of small
tensors, 50% more).

As a codec (``--compress chunktopk:k=64,bits=2``) it is a top-k with error feedback for any
algorithm that takes ``--compress`` (``decay`` < 1 decays the residual, SparseLoCo's beta);
``sync/sparseloco.py`` uses ``encode``/``decode`` directly and keeps its own buffer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from geotrain.comm.buckets import Pending, unflatten_into
from geotrain.comm.communicator import Communicator
from geotrain.comm.guard import message_norm
from geotrain.compress.codec import Codec, Shapes, numel, require

VALUE_BITS = (2, 4, 8)
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a message's scales, value codes, indices


def require_chunking(
    chunk: int, k: int, bits: int, flag, chunk_means: str, k_limit: int, k_limit_text: str
) -> None:
    """The checks every user of chunked top-k makes, worded with ``flag(name)`` (a CLI flag or a
    codec parameter) so the message says what to change."""
    require(
        isinstance(chunk, int) and chunk >= 2,
        f"{flag('chunk')} ({chunk_means}) must be an integer >= 2, got {chunk}",
    )
    require(
        isinstance(k, int) and 1 <= k <= k_limit,
        f"{flag('k')} (values sent per chunk) must be an integer in [1, {k_limit_text}], got {k}",
    )
    require(
        bits in VALUE_BITS,
        f"{flag('bits')} (per value sent) must be one of {', '.join(map(str, VALUE_BITS))}, got {bits}",
    )


def index_bits(chunk: int) -> int:
    """Bits that hold an index in ``[0, chunk)``."""
    return max(1, (chunk - 1).bit_length())


def packed_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integer codes < 2**bits -> uint8, ``bits`` bits each, little-endian bit order
    (code i's bit b is bit ``i * bits + b`` of the stream).

    Whole codes are shifted into bytes where ``bits`` divides 8 (2-bit values: four a byte) and
    two 12-bit codes into three bytes (the indices of a chunk of 4096): bit planes, the general
    path, cost a byte per bit of every code (GPT ``mini``'s messages spent 13 ms a model in them)."""
    require(1 <= bits <= 16, f"pack_bits: bits must be in [1, 16], got {bits}")
    codes = codes.reshape(-1)
    count = codes.numel()
    device = codes.device
    if 8 % bits == 0 or bits == 12:
        per = 2 if bits == 12 else 8 // bits  # codes per group of ``bits * per / 8`` bytes
        pad = -count % per
        wide = codes.to(torch.int32)
        if pad:
            wide = torch.cat([wide, torch.zeros(pad, dtype=torch.int32, device=device)])
        wide = wide.reshape(-1, per)
        if bits == 12:
            low, high = wide[:, 0], wide[:, 1]
            grouped = torch.stack([low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4], dim=1)
        else:
            shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=device)
            grouped = (wide << shifts).sum(dim=1, dtype=torch.int32)
        return grouped.to(torch.uint8).reshape(-1)[: packed_bytes(count, bits)]
    return _pack_bit_planes(codes, bits)


def _pack_bit_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_bits`` for any width, one bit plane at a time (and the layout's reference)."""
    codes = codes.reshape(-1).to(torch.int32)
    device = codes.device
    shifts = torch.arange(bits, dtype=torch.int32, device=device)
    planes = ((codes.unsqueeze(1) >> shifts) & 1).to(torch.uint8)
    stream = planes.reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, torch.zeros(pad, dtype=torch.uint8, device=device)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    return (stream.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: ``count`` int64 codes.

    Read whole codes, not bit planes (a plane per bit cost 5 ms for GPT ``mini``'s 12-bit
    indices, and a message is unpacked by every receiver): where ``bits`` divides 8 each byte
    holds ``8 / bits`` codes, and 12-bit codes come two from every three bytes; otherwise each
    code is cut from the (at most) three bytes it spans."""
    require(1 <= bits <= 16, f"unpack_bits: bits must be in [1, 16], got {bits}")
    require(
        packed.dtype == torch.uint8 and packed.numel() >= packed_bytes(count, bits),
        f"unpack_bits: {count} codes of {bits} bits need {packed_bytes(count, bits)} uint8 bytes, "
        f"got {packed.numel()} {packed.dtype}",
    )
    return unpack_rows(packed.reshape(1, -1), bits, count)[0]


def unpack_rows(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """``unpack_bits`` of each row of a 2-d uint8 tensor (each row a packed stream of at least
    ``count`` codes): (rows, count) int64, in one pass for every row where the width allows (a
    gathered message per row: a receiver unpacks every worker's at once, not each in turn, and
    the calls were a fifth of DreamDDP's codec time a layer)."""
    rows, size = packed.shape
    device = packed.device
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(rows, -1)[:, :count].to(torch.int64)
    if bits == 12:
        need = 3 * -(-count // 2)  # whole groups of three bytes (a last half group padded)
        data = packed[:, :need]
        if size < need:
            data = torch.cat([data, torch.zeros(rows, need - size, dtype=torch.uint8, device=device)], dim=1)
        group = data.reshape(rows, -1, 3).to(torch.int64)
        low = group[..., 0] | ((group[..., 1] & 0xF) << 8)
        high = (group[..., 1] >> 4) | (group[..., 2] << 4)
        return torch.stack([low, high], dim=-1).reshape(rows, -1)[:, :count]
    start = torch.arange(count, dtype=torch.int64, device=device) * bits
    first = start >> 3
    padded = torch.cat([packed, torch.zeros(rows, 2, dtype=torch.uint8, device=device)], dim=1).to(
        torch.int32
    )
    word = padded[:, first] | (padded[:, first + 1] << 8) | (padded[:, first + 2] << 16)
    return ((word >> (start & 7).to(torch.int32)) & mask).to(torch.int64)


# Rows at least this long pick their top k in two rounds (``top_k_indices``)
TWO_ROUNDS_FROM = 1024
TWO_ROUNDS_SLICES = 4


def top_k_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest values in each row of a 2-d tensor (in no order): a top
    k, ties broken as they fall. A long row is cut into ``TWO_ROUNDS_SLICES`` slices side by
    side, and column j's block is its j-th value in each slice: the k blocks with the largest
    maxima hold a top k of the row (any value outside them is at most the k-th largest block
    maximum, and at least k values of the row are as large), so the top k of those k x slices
    candidates is one. On this machine's CPU that takes 43 ms where ``torch.topk`` over GPT
    ``mini``'s rows of 4096 takes 55 (it costs more per value the longer the row)."""
    rows, length = magnitudes.shape
    q = TWO_ROUNDS_SLICES
    w = length // q
    if length < TWO_ROUNDS_FROM or length % q or w < 2 * k:
        return magnitudes.topk(k, dim=1, sorted=False).indices
    best = torch.maximum(magnitudes[:, :w], magnitudes[:, w : 2 * w])
    for j in range(2, q):
        torch.maximum(best, magnitudes[:, j * w : (j + 1) * w], out=best)
    blocks = best.topk(k, dim=1, sorted=False).indices
    offsets = torch.arange(0, length, w, device=magnitudes.device).view(1, 1, q)
    candidates = (blocks.unsqueeze(-1) + offsets).reshape(rows, k * q)
    return candidates.gather(1, magnitudes.gather(1, candidates).topk(k, dim=1, sorted=False).indices)


class TensorChunks:
    """Tensors laid end to end, each padded with zeros to a multiple of ``chunk``, so that no
    chunk spans two tensors (the paper chunks each tensor on its own: a chunk of a LayerNorm's
    gains does not compete with a weight matrix for its k entries). ``mask`` marks the real
    entries; a caller keeps the padding at zero with it.

    Moves in and out of the layout are copies of one slice per tensor: a boolean-mask gather or
    scatter of the whole vector took 0.45-0.6 s on GPT ``mini`` (11M entries) on this machine's
    CPU, a slice copy a memcpy's time, and SparseLoCo makes several a period.

    ``device``: where ``mask`` and a new vector from ``flatten`` are made (default: the CPU,
    whatever the tensors' device: a caller keeps its vectors there); ``padded_from_real`` makes
    its vector on the device of the one it is given."""

    def __init__(self, sizes: list[int], chunk: int, device: torch.device | str | None = None) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.chunk = chunk
        self.sizes = list(sizes)
        self.padded = [-(-n // chunk) * chunk for n in self.sizes]
        self.numel = sum(self.padded)
        self.real = sum(self.sizes)
        self.offsets = [0, *itertools.accumulate(self.padded)][:-1]  # each tensor's, in the layout
        self.mask = torch.zeros(self.numel, dtype=torch.bool, device=self.device)
        for offset, n in zip(self.offsets, self.sizes, strict=True):
            self.mask[offset : offset + n] = True

    def _spans(self):
        """(offset in the layout, offset in the real vector, size) of each tensor."""
        real = 0
        for offset, n in zip(self.offsets, self.sizes, strict=True):
            yield offset, real, n
            real += n

    def flatten(self, tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensors`` in the layout: into a new vector, or into ``out`` (its padding zeroed)."""
        if out is None:
            out = torch.zeros(self.numel, device=self.device)
        for (offset, _, n), padded, t in zip(self._spans(), self.padded, tensors, strict=True):
            out[offset : offset + n].copy_(t.detach().reshape(-1))
            out[offset + n : offset + padded].zero_()
        return out

    def copy_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Write a padded vector's real entries into ``tensors`` (the inverse of ``flatten``)."""
        for (offset, _, n), t in zip(self._spans(), tensors, strict=True):
            t.copy_(flat[offset : offset + n].view(t.shape))

    def difference(self, flat: torch.Tensor, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``flat`` - ``tensors`` (in the layout) into ``out``, its padding zero: one pass per
        tensor, without copying them into the layout first (where they are on ``out``'s device;
        a GPU's are copied over first)."""
        for (offset, _, n), t in zip(self._spans(), tensors, strict=True):
            part, src = out[offset : offset + n], t.detach().reshape(-1)
            if src.device != part.device:
                src = part.copy_(src)
            torch.sub(flat[offset : offset + n], src, out=part)
        self.zero_padding(out)
        return out

    def add_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """``tensors`` += ``flat``'s real entries, in place (added on ``flat``'s device)."""
        for (offset, _, n), t in zip(self._spans(), tensors, strict=True):
            part = flat[offset : offset + n].view(t.shape)
            if t.device == part.device:
                t.add_(part)
            else:
                t.copy_(t.detach().to(part.device).add_(part))

    def add_into_at(self, idx: torch.Tensor, values: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """``tensors`` += a sparse vector in the layout, in place: ``values`` at ``idx``, each
        (chunks, m), the indices within each chunk of the layout. An entry named twice must
        carry the same value each time (it is added once); one in the padding is left out. A
        pass over the entries named, not over the tensors."""
        if idx.shape[1] == 0:
            return
        for (offset, _, n), padded, t in zip(self._spans(), self.padded, tensors, strict=True):
            first, last = offset // self.chunk, (offset + padded) // self.chunk
            starts = torch.arange(0, padded, self.chunk, device=idx.device).view(-1, 1)
            at = (idx[first:last] + starts).reshape(-1)
            real = at < n
            at, add = at[real].to(t.device), values[first:last].reshape(-1)[real].to(t.device)
            flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
            flat.index_put_((at,), flat[at] + add)  # written, not accumulated: a twice-named entry once
            if flat.data_ptr() != t.data_ptr():
                t.copy_(flat.view(t.shape))

    def zero_padding(self, flat: torch.Tensor) -> None:
        """Set a padded vector's padding to zero, in place (a slice per tensor, not a pass over
        the whole vector)."""
        for (offset, _, n), padded in zip(self._spans(), self.padded, strict=True):
            flat[offset + n : offset + padded].zero_()

    def padded_from_real(self, real: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.numel, device=real.device)
        for offset, start, n in self._spans():
            out[offset : offset + n].copy_(real[start : start + n])
        return out


@dataclass
class ChunkTopK(Codec):
    name = "chunktopk"
    summary = "top-k per chunk, values in 2-8 bits, packed indices, all-gathered, error feedback"
    chunk: int = 4096
    k: int = 64
    bits: int = 2
    decay: float = 1.0  # the residual is multiplied by this before the next message is added
    # As a codec for any algorithm: each entry of the mean over the workers that sent it (the
    # SparseLoCo reference's mean), not over every worker (an entry one worker sent moves by 1/N
    # of it). Left out of the spec at its default, so specs saved before it still match.
    senders: bool = field(default=False, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        self._held: tuple[torch.Tensor, ...] | None = None  # ``_scratch``'s vectors
        require_chunking(
            self.chunk, self.k, self.bits, lambda f: f"{self.name}: {f}", "values per chunk",
            self.chunk, f"chunk={self.chunk}",
        )  # fmt: skip
        require(
            0 <= self.decay <= 1,
            f"{self.name}: decay (residual kept per message) must be in [0, 1], got {self.decay}",
        )

    # -- the local codec ------------------------------------------------------------------------
    def chunks(self, n: int) -> int:
        return max(1, -(-n // self.chunk))

    def payload_bytes(self, n: int) -> int:
        """Bytes of one worker's message for a vector of ``n`` values."""
        c = self.chunks(n)
        return 4 * c + packed_bytes(c * self.k, self.bits) + packed_bytes(c * self.k, index_bits(self.chunk))

    def encode(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """1-d float ``v`` -> (payload uint8, the dense float vector the receivers decode)."""
        payload, idx, values = self.encode_sparse(v)
        dense = torch.zeros(idx.shape[0], self.chunk, device=v.device)
        dense.scatter_(1, idx, values)
        return payload, dense.reshape(-1)[: v.numel()]

    def encode_sparse(
        self, v: torch.Tensor, work: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """1-d float ``v`` -> (payload uint8, the indices sent within each chunk, (chunks, k)
        int64, and the values the receivers decode at them, (chunks, k) float): what was sent,
        without the dense vector ``encode`` spreads it into. A caller that takes it from its own
        vectors at those indices (``rows.scatter_add_(1, idx, -values)``) spares two passes over
        the whole vector and a fresh one of its size (page faults, on a CPU: a message of GPT
        ``mini`` took 125 ms with them). ``work``: a float vector of at least ``chunks(n) *
        chunk`` values the magnitudes are written into instead of a new one (its contents are
        lost)."""
        n = v.numel()
        c = self.chunks(n)
        if n == c * self.chunk:  # DeMo's blocks tile their parameters: no padded copy
            rows = v.reshape(c, self.chunk)
        else:
            rows = torch.zeros(c * self.chunk, device=v.device)
            rows[:n] = v
            rows = rows.reshape(c, self.chunk)
        if work is not None and work.numel() >= rows.numel() and work.dtype == rows.dtype:
            magnitudes = torch.abs(rows, out=work.reshape(-1)[: rows.numel()].view(c, self.chunk))
        else:
            magnitudes = rows.abs()
        idx = top_k_indices(magnitudes, self.k)
        picked = rows.gather(1, idx)
        scales = picked.abs().amax(dim=1, keepdim=True)
        top = 2**self.bits - 1
        # Level j of 0..top stands for (2j - top) / top * scale: symmetric, without zero.
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round((picked / safe * top + top) / 2).clamp_(0, top).to(torch.int64)
        payload = torch.cat(
            [
                scales.reshape(-1).contiguous().view(torch.uint8),
                pack_bits(codes, self.bits),
                pack_bits(idx, index_bits(self.chunk)),
            ]
        )
        return payload, idx, self._values(scales, codes)

    def parts_of(self, payloads: torch.Tensor, n: int) -> list[Parts | None]:
        """Each gathered payload's (scales, codes, indices), None for an empty one (an adopter's
        stand-in: see ``_kept``): unpacked once for both ``norms`` and the mean, every payload
        in the same few calls."""
        scales, codes, idx = self._unpacked(payloads, n)
        present = payloads.any(dim=1).tolist()
        return [(scales[r], codes[r], idx[r]) if present[r] else None for r in range(len(present))]

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """A payload from ``encode`` of a vector of ``n`` values -> that dense float vector."""
        scales, codes, idx = (part[0] for part in self._unpacked(payload.reshape(1, -1), n))
        return self._scatter(scales, codes, idx, n)

    def _unpacked(self, payloads: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stacked payloads (one a row) -> their scales (rows, chunks, 1), codes and indices
        (rows, chunks, k)."""
        c = self.chunks(n)
        require(
            payloads.shape[-1] == self.payload_bytes(n),
            f"{self.name}: a message of {payloads.shape[-1]} bytes cannot hold {n} values "
            f"(expected {self.payload_bytes(n)})",
        )
        rows = payloads.shape[0]
        nvalue = packed_bytes(c * self.k, self.bits)
        # a copy, aligned for floats and not a view of the payloads (which may be reused)
        scales = payloads[:, : 4 * c].clone(memory_format=torch.contiguous_format)
        scales = scales.view(torch.float32).reshape(rows, c, 1)
        codes = unpack_rows(payloads[:, 4 * c : 4 * c + nvalue], self.bits, c * self.k)
        idx = unpack_rows(payloads[:, 4 * c + nvalue :], index_bits(self.chunk), c * self.k)
        return scales, codes.reshape(rows, c, self.k), idx.reshape(rows, c, self.k)

    def _values(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        top = 2**self.bits - 1
        return (2 * codes.float() - top) / top * scales

    def _scatter(self, scales: torch.Tensor, codes: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
        dense = torch.zeros(scales.shape[0], self.chunk, device=scales.device)
        dense.scatter_(1, idx, self._values(scales, codes))
        return dense.reshape(-1)[:n]

    # -- as a codec for any algorithm --------------------------------------------------------------
    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        # Made in two scratch vectors of whole chunks the codec keeps (``_scratch``), not in
        # vectors allocated per message: a fresh vector of a layer's size is a page fault per
        # page on a CPU, and its dense copies (the flat message, the decoded message, the
        # residual, the mean) were half of a layer's encode and mean (DreamDDP's, W1).
        state = self.state(key)
        n = sum(t.numel() for t in tensors)
        c = self.chunks(n)
        message, work = self._scratch(c * self.chunk, tensors[0].device)
        offset = 0
        for t in tensors:  # the flat message, in place (``flatten``'s bits)
            message[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        message[n:].zero_()
        v = message[:n]
        residual = state.get("residual")
        if residual is not None and residual.shape != v.shape:
            residual = None  # another layout's (a group of another size): not this message's
        if residual is not None:
            v += residual.mul_(self.decay) if self.decay != 1 else residual
        spoiled = comm.spoiled(v)  # --chaos corrupt: a spoiled message, the residual kept clean
        payload, idx, values = self.encode_sparse(message, work=work)
        rows = message.view(c, self.chunk)
        rows.scatter_add_(1, idx, values.neg_())  # v - sent: what was kept out (padding dropped)
        if residual is None:
            state["residual"] = v.clone()
        else:
            residual.copy_(v)
        if spoiled is not None:
            payload = self.encode(spoiled)[0]
        handle = comm.all_gather(payload, async_op=True)

        def finish() -> None:
            payloads = handle.wait()
            parts = self.parts_of(payloads, n)
            weights = comm.weigh_gathered(self.norms(payloads, n, parts)) if comm.screening else None
            if weights is not None and not any(weights):  # nothing to average: each keeps its own
                return
            mean = self.mean_of(payloads, n, weights, per_sender=self.senders, out=work, parts=parts)
            unflatten_into(mean, tensors)

        return Pending(finish)

    def _scratch(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two float vectors of at least ``size`` values on ``device``, kept across messages
        and shared by every stream (the largest stream's size): a message is encoded, and a mean
        made, whole, one at a time on the calling thread, so no two uses overlap. Not state: a
        snapshot does not hold them."""
        held = self._held
        if held is None or held[0].numel() < size or held[0].device != torch.device(device):
            held = self._held = tuple(torch.empty(size, dtype=torch.float32, device=device) for _ in range(2))
        return held[0][:size], held[1][:size]

    def norms(
        self, payloads: torch.Tensor, n: int, parts: list[Parts | None] | None = None
    ) -> list[tuple[float, bool]]:
        """Each payload's decoded L2 norm and whether it decodes to finite values (the norm
        check's inputs, ``Communicator.weigh_gathered``). A payload whose indices repeat within
        a chunk, or point past it, is counted as not finite: with distinct indices the norm of
        its values is the norm of the vector it stands for, and only then. ``parts``: the
        payloads' ``parts_of``, where the caller has them."""
        judged = []
        for part in self.parts_of(payloads, n) if parts is None else parts:
            if part is None:  # an adopter's empty stand-in (see mean_of): nothing to judge
                judged.append((0.0, True))
                continue
            scales, codes, idx = part
            ordered = idx.sort(dim=1).values  # distinct and inside the chunk, or it is refused
            valid = bool(ordered[:, -1].lt(self.chunk).all() and ordered.diff(dim=1).gt(0).all())
            judged.append(message_norm(self._values(scales, codes), valid))
        return judged

    def mean_of(
        self,
        payloads: torch.Tensor,
        n: int,
        weights: list[float] | None = None,
        per_sender: bool = False,
        out: torch.Tensor | None = None,
        parts: list[Parts | None] | None = None,
    ) -> torch.Tensor:
        """Every worker's payload (stacked, rank order) -> the dense mean of the decoded vectors
        (``dense_mean``, zero where no message holds an entry), a vector of ``n``. ``out``: a
        vector of ``chunks(n) * chunk`` values to make it in (a caller's work vector), not a new
        one."""
        c = self.chunks(n)
        work = None if out is None else out.view(c, self.chunk)
        return self.dense_mean(payloads, n, weights, per_sender, out=work, parts=parts).reshape(-1)[:n]

    def _kept(
        self, payloads: torch.Tensor, n: int, weights: list[float] | None, parts: list[Parts | None] | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each message the mean counts: its indices and values (weighed), in rank order. An
        all-zero payload is the empty stand-in of a worker that adopted another's state
        (``sync.base.InFlight.adopted``), and counting it would shrink the mean. (A real payload
        is never all zero bytes unless its whole chunk of the buffer is zero with k = 1, which
        then adds nothing either way but the divisor.) ``weights`` (the norm check's, by rank): a
        payload of weight 0 is left out, one below 1 is scaled down (``--aggregate clip``)."""
        kept = []
        for r, part in enumerate(self.parts_of(payloads, n) if parts is None else parts):
            weight = 1.0 if weights is None else weights[r]
            if weight == 0 or part is None:
                continue
            scales, codes, idx = part
            values = self._values(scales, codes)
            kept.append((idx, values if weight == 1 else values * weight))
        return kept

    def dense_mean(
        self,
        payloads: torch.Tensor,
        n: int,
        weights: list[float] | None = None,
        per_sender: bool = False,
        out: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        parts: list[Parts | None] | None = None,
    ) -> torch.Tensor:
        """``sparse_mean`` spread out: a (chunks, chunk) tensor holding the mean where some kept
        message holds an entry and zero elsewhere, to the bit the sparse mean's values. A pass or
        two over the whole vector, where the sparse mean makes several at the entries the
        messages hold: on a CPU a value read or written at a random entry costs about 20-30 times
        one in a pass, so with four workers' messages of 1/64 of the entries the passes are the
        cheaper (GPT ``mini``, one thread: a landing inside the period 110 ms at the entries, 69
        in passes). ``out``: a (chunks, chunk) float tensor to make it in (its contents are
        lost); ``counts``: as ``sparse_mean``'s."""
        c = self.chunks(n)
        kept = self._kept(payloads, n, weights, parts)
        total = torch.zeros(c, self.chunk, device=payloads.device) if out is None else out.zero_()
        for idx, values in kept:  # indices within one payload are distinct: scatter-add is exact
            total.scatter_add_(1, idx, values)
        if not kept:
            return total
        if not per_sender:
            return total.div_(len(kept))
        # At the entries held alone: a division by the whole integer tally would first make a
        # float copy of it (a vector the model's size, its page faults: 30 ms on mini).
        touched = torch.cat([idx for idx, _ in kept], dim=1)
        senders = self._senders_at(kept, touched, counts, c)
        total.scatter_(1, touched, total.gather(1, touched).div_(senders))
        return total

    def _senders_at(
        self,
        kept: list[tuple[torch.Tensor, torch.Tensor]],
        touched: torch.Tensor,
        counts: torch.Tensor | None,
        c: int,
    ) -> torch.Tensor:
        """How many of the ``kept`` messages hold each entry of ``touched`` ((chunks, m)),
        counted in ``counts`` (a (chunks, chunk) integer tally, all zero, left all zero whatever
        happens here; made where not given)."""
        if counts is None:
            counts = torch.zeros(c, self.chunk, dtype=torch.int32, device=touched.device)
        require(
            len(kept) <= torch.iinfo(counts.dtype).max,
            f"{self.name}: {len(kept)} senders overflow a {counts.dtype} count",
        )
        one = torch.ones((), dtype=counts.dtype, device=counts.device).expand(kept[0][0].shape)
        try:
            for idx, _ in kept:  # a sender counts once, its weight (a clip) stays on its values
                counts.scatter_add_(1, idx, one)
            return counts.gather(1, touched)
        finally:
            counts.scatter_(1, touched, 0)

    def sparse_mean(
        self,
        payloads: torch.Tensor,
        n: int,
        weights: list[float] | None = None,
        per_sender: bool = False,
        work: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        parts: list[Parts | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every worker's payload (stacked, rank order) -> the mean of the decoded vectors over
        the workers that sent one, sparse: ``(touched, mean)``, (chunks, m) each, the indices
        within each chunk that some message holds (an entry two sent appears twice, with the
        same mean) and the mean there; it is zero everywhere else. The messages counted and their
        weights are ``_kept``'s.
        ``per_sender``: each entry is divided by the number of workers whose message holds it,
        not by the number of workers (the SparseLoCo reference's ``scatter_reduce(reduce="mean",
        include_self=False)``): an entry one worker picked moves by its value, not a fraction of
        it.

        Summed in rank order on every worker, so every replica gets the same bits. Nothing here
        is a pass over the whole vector: where the messages hold few entries (a worker's own
        message alone), a caller that applies the mean where it is nonzero spares the
        passes of ``dense_mean``. ``work``: a (chunks, chunk) float tensor the sums are made
        in, at the touched entries only (the rest of it is left as it was); ``counts``: a
        (chunks, chunk) integer tensor, all zero, that the per-sender counts are made in and
        that is left all zero (a caller keeps one across outer steps); each is made where not
        given. ``parts``: the payloads' ``parts_of``, where the caller has them."""
        c = self.chunks(n)
        kept = self._kept(payloads, n, weights, parts)
        if not kept:
            nothing = torch.zeros(c, 0, device=payloads.device)
            return nothing.long(), nothing
        touched = torch.cat([idx for idx, _ in kept], dim=1)
        sums = torch.empty(c, self.chunk, device=touched.device) if work is None else work
        sums.scatter_(1, touched, 0.0)
        for idx, values in kept:  # indices within one payload are distinct: scatter-add is exact
            sums.scatter_add_(1, idx, values)
        mean = sums.gather(1, touched)
        if not per_sender:
            return touched, mean.div_(len(kept))
        return touched, mean.div_(self._senders_at(kept, touched, counts, c))

    def wire_bytes(self, shapes: Shapes, world_size: int) -> int:
        return (world_size - 1) * self.payload_bytes(sum(numel(s) for s in shapes))

    def info(self) -> str:
        return f"{self.k} of every {self.chunk} values ({100 * self.k / self.chunk:.3g}%), {self.bits}-bit"


__all__ = [
    "ChunkTopK",
    "TensorChunks",
    "index_bits",
    "pack_bits",
    "require_chunking",
    "top_k_indices",
    "unpack_bits",
    "unpack_rows",
]
