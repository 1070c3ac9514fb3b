"""Quantising codecs: fewer bits per value, error feedback for what the rounding lost.

- ``fp16``, ``bf16``: cast; the halves are summed by the all-reduce itself (2 bytes per value).
- ``int8``, ``int4``: symmetric per-block quantisation, one fp32 scale per ``block`` values (the
  block's largest magnitude maps to 127 or 7), as Streaming DiLoCo sends its outer gradients.
- ``sign``: 1 bit per value and one scale per block, the block's mean magnitude (EF-SignSGD,
  Karimireddy et al. 2019; 1-bit Adam, Tang et al. 2021): 32 values in 4 bytes.

Quantised values cannot be summed by an all-reduce, so these use the compressed all-reduce of
1-bit Adam: the vector is cut into one chunk per worker; an all-to-all sends chunk j of every
worker to worker j, which averages the decompressed chunks, adds its own (server) error feedback,
quantises the mean again and all-gathers it. Each worker sends 2 (N-1)/N of the compressed size,
as a ring all-reduce would of the raw size. Every worker decodes the same bytes, so replicas agree.

``owners=2`` gives every shard of the mean a second owner (worker j's shard is also computed by
worker j+1, from the same rows, with error feedback of its own for it): both copies are
all-gathered and every worker compares their bytes before it takes the shard. A shard whose
owners disagree (an owner that spoiled it, or a sender that sent its two owners different rows)
gets no average this time, on every worker alike, and the pair is counted
(``Communicator.disputed_shards``). Twice both phases' bytes: what catches the spoiled shard
that the first phase's norms cannot (a flipped sign, a scaling within their bound). Which
owner of a disputed shard is wrong, where a run of disputes can say: ``compress.owners``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from geotrain.comm.buckets import Pending, flatten, unflatten_into
from geotrain.comm.communicator import Communicator, corrupt_
from geotrain.comm.guard import BOUND_BYTES, GATHERED, agreed_shard_bound, robust_mean, shard_bound_bytes
from geotrain.compress import owners
from geotrain.compress.codec import Codec, Shapes, drop_if_not_finite, numel, require, ring_bytes


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class _Cast(Codec):
    dtype: ClassVar[torch.dtype] = torch.float16

    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        state = self.state(key)
        v = flatten(tensors).float()
        if "residual" in state:
            v += state["residual"]
        low = v.to(self.dtype)
        state["residual"] = drop_if_not_finite(v - low.float(), comm)
        handle = comm.all_reduce(low, op="mean", async_op=True)
        return Pending(lambda: unflatten_into(handle.wait().float(), tensors))

    def wire_bytes(self, shapes: Shapes, world_size: int) -> int:
        n = sum(numel(s) for s in shapes)
        return ring_bytes(n * torch.finfo(self.dtype).bits // 8, world_size)


@dataclass
class FP16(_Cast):
    name = "fp16"
    summary = "half precision, summed by the all-reduce (2 bytes/value)"
    dtype = torch.float16


@dataclass
class BF16(_Cast):
    name = "bf16"
    summary = "bfloat16, summed by the all-reduce (2 bytes/value)"
    dtype = torch.bfloat16


@dataclass
class _BlockQuantizer(Codec):
    """Per-block scaled quantiser over rows of equal length; the wire format is one uint8 row."""

    bits: ClassVar[int] = 8
    block: int = 256
    # 2: each shard of the mean computed by two workers and compared (module docstring)
    owners: int = field(default=1, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.block >= 8 and self.block % 8 == 0,
            f"{self.name}: block (values per scale) must be a multiple of 8, >= 8; got {self.block}",
        )
        require(
            self.owners in (1, 2),
            f"{self.name}: owners (workers that compute each shard of the mean) must be 1 or 2; "
            f"got {self.owners}",
        )

    # -- the local codec --------------------------------------------------------------------
    def layout(self, n: int, world_size: int) -> tuple[int, int]:
        """(block, chunk): each worker's chunk holds ``chunk`` values in whole blocks.

        Small tensors get a smaller block, so padding never exceeds 8 values per worker.
        """
        per = -(-n // world_size)
        block = min(self.block, _round_up(max(per, 1), 8))
        return block, _round_up(max(per, 1), block)

    def row_bytes(self, chunk: int, block: int) -> int:
        return chunk * self.bits // 8 + 4 * (chunk // block)

    def encode(self, rows: torch.Tensor, block: int) -> torch.Tensor:
        """(R, chunk) float -> (R, row_bytes) uint8: packed values, then fp32 scales."""
        return self.encode_with_values(rows, block)[0]

    def encode_with_values(
        self, rows: torch.Tensor, block: int, room: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode``, and what ``decode`` will make of it ((R, chunk) float, bitwise the same),
        from the quantiser's own integers: the error feedback needs it, and unpacking the bytes
        again would cost as much as packing them. ``room``: bytes left free at the end of each
        row (the check's norm, written there by the caller)."""
        r, chunk = rows.shape
        x = rows.reshape(r, chunk // block, block)
        # Each quantiser's decoded values are what its bytes decode to, non-finite blocks too (a
        # NaN level is set before the cast), so nothing is decoded twice nor asked of a GPU here.
        values, scales, decoded = self._quantize(x)
        nbytes = self.row_bytes(chunk, block)
        data = torch.empty(r, nbytes + room, dtype=torch.uint8, device=rows.device)
        nvalue = chunk * self.bits // 8
        data[:, :nvalue] = values.reshape(r, -1)
        data[:, nvalue:nbytes] = scales.reshape(r, -1).view(torch.uint8)
        return data, decoded.reshape(r, chunk)

    def decode(self, data: torch.Tensor, chunk: int, block: int) -> torch.Tensor:
        r = data.shape[0]
        nvalue = chunk * self.bits // 8
        scales = data[:, nvalue:].flatten().clone().view(torch.float32).reshape(r, chunk // block, 1)
        x = self._dequantize(data[:, :nvalue].reshape(r, chunk // block, -1), scales)
        return x.reshape(r, chunk)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, blocks, block) float -> (packed values, scales (R, blocks, 1), the decoded values)."""
        raise NotImplementedError

    def _dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def roundtrip(self, v: torch.Tensor) -> torch.Tensor:
        """What the receiver decodes from ``v`` (1-d), for tests and error-feedback checks."""
        block, chunk = self.layout(v.numel(), 1)
        padded = v.new_zeros(chunk, dtype=torch.float32)
        padded[: v.numel()] = v
        return self.decode(self.encode(padded.unsqueeze(0), block), chunk, block)[0, : v.numel()]

    # -- the compressed all-reduce ---------------------------------------------------------------
    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        state = self.state(key)
        n, world = sum(t.numel() for t in tensors), comm.world_size
        block, chunk = self.layout(n, world)
        # flattened and padded to whole chunks in one copy, on the tensors' device (a GPU's
        # gradients are quantised there; the uint8 rows travel by NCCL)
        pad = tensors[0].new_zeros(world * chunk - n)
        v = torch.cat([*(t.detach().reshape(-1) for t in tensors), pad]).float()
        regrouped = False
        if "residual" in state:
            residual = state["residual"]
            if residual.numel() != v.numel():
                # The group changed size (a lost worker): the padding changes with it. This
                # worker's own error carries over.
                residual = torch.cat([residual[:n], v.new_zeros(v.numel() - n)])
                regrouped = True
            v += residual
        for name in ("server_residual", "second_residual"):
            # Its share of the mean (a shard's residual) was another chunk where the group's size
            # changed, even where the padded total did not (5 x 1024 = 4 x 1280): dropped.
            if name in state and (regrouped or state[name].numel() != chunk):
                del state[name]
        # The norm check judges what is sent, before it is quantised (``screen`` zeroes a message
        # left out, scales a clipped one). The residual keeps only the quantisation error of what
        # was sent: a message left out or clipped is dropped, not carried into the next one, where
        # a spike (or a NaN) would grow and be rejected again and again.
        spoiled = comm.spoiled(v) if world > 1 else None  # --chaos corrupt: the message only
        # Checked in band (not clipped): each row carries this worker's norm, and the verdict is
        # taken where the rows arrive, with no round trip before the all-to-all. A message left
        # out has then been sent, and is dropped by every owner; its residual is dropped on
        # arrival, as if zeros had been sent.
        in_band, out = comm.judges_rows_in_band, comm.left_out
        screened = comm.screening and world > 1 and not in_band
        sent = spoiled if spoiled is not None else (v.clone() if screened else v)
        verdict = None if in_band else comm.screen(sent)
        if verdict is not None and verdict.count == 0:  # nothing to average: each keeps its own
            return Pending(lambda: None)
        norm = comm.norm_bytes(sent) if in_band else None
        control = norm.numel() if in_band else 0
        data, decoded = self.encode_with_values(sent.reshape(world, chunk), block, room=control)
        if in_band:
            data[:, -control:] = norm
        if spoiled is not None:  # spoiled on the way: the residual is that of the message meant
            sent, decoded = v, self.encode_with_values(v.reshape(world, chunk), block)[1]
        decoded = decoded.view(-1)
        state["residual"] = torch.sub(sent, decoded, out=decoded)
        if in_band and spoiled is None and not comm.finite_in(norm):  # a copy left out sends 0: finite
            # Left out wherever it arrives, as this worker knows already: its residual dropped
            # now, so that a message abandoned before it is judged (a regroup) does not carry it.
            state["residual"].zero_()
        if world == 1:
            return Pending(lambda: unflatten_into(v[:n] - state["residual"][:n], tensors))
        pairs = self.owners == 2
        # shard j's second owner: worker j + offset (1 until a spoiled copy moves it: owners.settle)
        offset, count = owners.read_stamp(state, world) if pairs else (0, 0)
        if pairs:  # to worker j: shard j's row, for its owner, and shard j-offset's, for its second
            data = torch.cat([data, data.roll(offset, dims=0)], dim=1)
        handle = comm.all_to_all(data, async_op=True, control_bytes=control * (2 if pairs else 1))

        gather: list = []  # the second phase's collective, launched by advance()

        def shard_mean(received: torch.Tensor) -> torch.Tensor:
            """One shard of the mean from every worker's row of it (as received)."""
            rows = self.decode(received, chunk, block)
            if verdict is None:
                return rows.mean(dim=0)
            # every kept contribution's row: the mean or a robust statistic
            kept = rows.index_select(0, _kept_index(verdict.kept, rows.device))
            kind, f = comm.aggregate_kind
            return robust_mean(kept, kind, f) if kind in GATHERED else kept.sum(dim=0).div_(verdict.count)

        def advance() -> None:
            nonlocal verdict
            received = handle.wait()
            parts = list(received.chunk(2, dim=1)) if pairs else [received]
            whole = parts  # as received, in-band norms included: what a copy's digest covers
            if in_band:
                if verdict is None:  # once: an advance run again must not count it twice
                    verdict = comm.judge_rows(parts[0][:, -control:], out)
                    if not verdict.kept[comm.rank] and spoiled is None:
                        state["residual"].zero_()  # its message dropped, not carried into the next
                parts = [p[:, :-control] for p in parts]
                # Nothing to average: each keeps its own tensors (its residual dropped with its
                # message, as any left-out worker's is; a round trip first kept the one before).
                if verdict.count == 0:
                    return
            # One owner: its shard goes out as encoded, with room left for the bound where the
            # check is in band (no copy on the message's path); two: both copies, with their tails.
            bound_room = BOUND_BYTES if in_band else 0
            room = 0 if pairs else bound_room
            nbytes = self.row_bytes(chunk, block)
            encoded, residuals = [], {}
            # its own shard, and with a second owner the shard of the worker before it
            for part, name in zip(parts, ("server_residual", "second_residual"), strict=False):
                mean = shard_mean(part)
                if name in state:
                    mean += state[name]
                mine, decoded_mine = self.encode_with_values(mean.unsqueeze(0), block, room=room)
                residuals[name] = torch.sub(mean, decoded_mine[0], out=decoded_mine[0])
                encoded.append(mine[0])
            spoil = comm.corrupt_shard
            if spoil:  # a worker that spoils its shard of the mean (a test's hook): its own copy
                bad_shard = self.decode(encoded[0][:nbytes].unsqueeze(0), chunk, block)
                corrupt_(bad_shard, spoil)
                encoded[0][:nbytes] = self.encode(bad_shard, block)[0]
            row = encoded[0]
            if pairs:  # each copy, the digest of what it was computed from, the owners' stamp
                kept = verdict.kept if verdict is not None else None
                said = count + 1 if comm.corrupt_stamp else count  # a false stamp (a test's hook)
                stamp = owners.stamp_bytes(offset, said, data.device)
                tails = [torch.cat([owners.digest(w, kept), stamp]) for w in whole]
                row = torch.cat([encoded[0], tails[0], encoded[1], tails[1], row.new_empty(bound_room)])
            if in_band:  # its verdict's bound for the shards' check, which every worker agrees on
                row[-BOUND_BYTES:] = shard_bound_bytes(verdict.shard_bound(), row.device)
            gather.append(comm.all_gather(row, async_op=True, control_bytes=BOUND_BYTES if in_band else 0))
            # kept once the second phase is under way: an advance that failed can be run again
            state.update(residuals)
            if spoil:
                comm.corrupt_shard = ""
            if pairs:
                comm.corrupt_stamp = False

        def finish() -> None:
            if not gather:  # in band, nothing kept: each keeps its own
                return
            gathered = gather.pop().wait()
            bound = None
            if in_band:
                bound, gathered = agreed_shard_bound(gathered[:, -BOUND_BYTES:]), gathered[:, :-BOUND_BYTES]
            copies = None
            if pairs:  # shard j's second copy is worker j+offset's (offset: the stamp's)
                copies = owners.judge_copies(*gathered.chunk(2, dim=1))
                gathered = copies.first
                if copies.in_step:
                    copies.disputed = comm.compare_shards(
                        gathered, copies.second, copies.offset, copies.same_inputs
                    )
            disputed = copies.disputed if copies is not None else []
            everyone = self.decode(gathered, chunk, block)
            for j in disputed:  # before the bound's check: a disputed shard is nobody's rejection
                everyone[j].zero_()
            if verdict is not None:  # the second phase checked too: each shard against the first's norms
                everyone = comm.check_shards(everyone, verdict, bound)
            if copies is not None:
                owners.settle(comm, state, copies, count, key)
            unflatten_into(everyone.reshape(-1)[:n], tensors)

        return Pending(finish, advance)

    def wire_bytes(self, shapes: Shapes, world_size: int) -> int:
        return sum(self.phase_bytes(shapes, world_size))

    def phase_bytes(self, shapes: Shapes, world_size: int) -> tuple[int, int]:
        """The quantised rows' all-to-all, then (launched by ``advance``) the mean's shards
        all-gathered (with two owners, each copy with its tail: ``owners.TAIL_BYTES``)."""
        if world_size == 1:
            return 0, 0
        block, chunk = self.layout(sum(numel(s) for s in shapes), world_size)
        row = self.row_bytes(chunk, block)
        tail = owners.TAIL_BYTES if self.owners == 2 else 0
        return self.owners * (world_size - 1) * row, self.owners * (world_size - 1) * (row + tail)


@dataclass
class Int8(_BlockQuantizer):
    name = "int8"
    summary = "8-bit, one scale per block (1 byte/value)"
    bits = 8

    def _quantize(self, x):
        scales = x.abs().amax(dim=-1, keepdim=True).div_(127)
        q = x / torch.where(scales > 0, scales, 1)
        q.round_().clamp_(-127, 127)
        q.nan_to_num_(nan=0.0)  # a non-finite block's inf / inf: the level 0, as its bytes decode
        values = q.to(torch.int8).view(torch.uint8)
        # + 0.0: a value rounded to -0.0 decodes as +0.0 (from the integer 0)
        return values, scales, q.mul_(scales).add_(0.0)

    def _dequantize(self, values, scales):
        return values.contiguous().view(torch.int8).float().mul_(scales)


@dataclass
class Int4(_BlockQuantizer):
    name = "int4"
    summary = "4-bit, one scale per block, two values per byte"
    bits = 4

    def _quantize(self, x):
        scales = x.abs().amax(dim=-1, keepdim=True).div_(7)
        q = x / torch.where(scales > 0, scales, 1)
        q.round_().clamp_(-7, 7).add_(8)  # 1..15: two to a byte, unsigned
        q.nan_to_num_(nan=8.0)  # a non-finite block's inf / inf: the level 0, as its bytes decode
        pairs = q.to(torch.uint8).view(*q.shape[:-1], -1, 2)
        packed = torch.add(pairs[..., 0], pairs[..., 1], alpha=16)  # low | high << 4
        return packed, scales, q.sub_(8).mul_(scales)

    def _dequantize(self, values, scales):
        q = torch.empty(*values.shape, 2, device=values.device)
        q[..., 0] = values & 15
        q[..., 1] = values >> 4
        return q.view(*values.shape[:-1], -1).sub_(8).mul_(scales)


_BIT_WEIGHTS = {torch.device("cpu"): torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)}


def _bit_weights(device: torch.device) -> torch.Tensor:
    """A byte's bit weights on ``device``, copied there once."""
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = _BIT_WEIGHTS[torch.device("cpu")].to(device)
    return _BIT_WEIGHTS[device]


def _kept_index(kept: list[bool], device: torch.device) -> torch.Tensor:
    """The rows a verdict keeps, as indices on ``device`` (a mask would ask the GPU their count)."""
    return torch.tensor([r for r, k in enumerate(kept) if k], dtype=torch.long, device=device)


@dataclass
class Sign(_BlockQuantizer):
    name = "sign"
    summary = "1 bit per value (sign) times the block's mean magnitude, 8 values per byte"
    bits = 1
    block: int = 1024

    def _quantize(self, x):
        scales = x.abs().mean(dim=-1, keepdim=True)
        positive = x >= 0
        bits = positive.to(torch.uint8).view(*x.shape[:-1], -1, 8)
        packed = (bits * _bit_weights(bits.device)).sum(dim=-1, dtype=torch.uint8)
        return packed, scales, positive.float().mul_(2).sub_(1).mul_(scales)

    def _dequantize(self, values, scales):
        bits = (values.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=values.device)) & 1
        signs = bits.reshape(*values.shape[:-1], -1).float().mul_(2).sub_(1)
        return signs.mul_(scales)
