"""Outer messages in 4 or 8 bits, all-gathered and averaged in fp32 after decoding.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) sends each fragment's outer gradient so:
int4 (or int8) with one fp32 scale per block of 256 values (the paper's format is a 4-bit float),
gathered from every worker and accumulated in full precision. CO2 (``--bits``) sends its
pseudo-gradients the same way, with error feedback: what the rounding lost is added to the next
period's message, as ``compress``'s int4 does for DiLoCo's all-reduce.

Quantised values cannot be summed by an all-reduce, so the messages are gathered: among N
workers each sends N - 1 messages of 1/8 (int4) of fp32, against a ring all-reduce's 2 (N - 1) / N
of fp32: N / 16 of its bytes (1/4 at N = 4; beyond 16 workers the gather sends more). ``bits`` 32
gathers the fp32 vectors themselves.
"""

from __future__ import annotations

import torch

from geotrain.comm.guard import message_norm
from geotrain.compress.quantize import Int4, Int8

BITS = (4, 8, 32)


class QuantizedGather:
    """Encodes a worker's flat fp32 vector into its message, and averages a gathered stack of
    messages (rows in rank order) in fp32. ``comm`` judges the decoded rows where it checks norms
    (``--max-norm-ratio``): with no communication, every worker holds every row."""

    def __init__(self, comm, bits: int = 4) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        self.comm = comm
        self.bits = bits
        self.quantizer = {4: Int4(), 8: Int8()}.get(bits)

    def payload_bytes(self, n: int) -> int:
        """Bytes of one worker's message for ``n`` values."""
        if self.quantizer is None:
            return 4 * n
        block, chunk = self.quantizer.layout(n, 1)
        return self.quantizer.row_bytes(chunk, block)

    def empty(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A message of ``n`` values that weighs nothing: all zero bytes, of the messages' dtype
        and size (fp32 values with ``bits`` 32, else the packed bytes), left out of ``mean``."""
        if self.quantizer is None:
            return torch.zeros(n, dtype=torch.float32, device=device)
        return torch.zeros(self.payload_bytes(n), dtype=torch.uint8, device=device)

    def encode(self, delta: torch.Tensor) -> torch.Tensor:
        """The message of ``delta`` (1-d), made on ``delta``'s device (on every worker alike: a
        restored or an adopter's empty message is made there too)."""
        return self.encode_with_feedback(delta, None)[0]

    def encode_with_feedback(
        self, delta: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The message of ``delta + residual`` (error feedback; ``residual`` None: of ``delta``),
        and what its rounding lost, the next message's residual (a new tensor: ``residual`` is
        left as it was, for a launch that fails to be sent again from it). Zeros where that is
        not finite: a NaN kept would spoil every later message."""
        if self.quantizer is None:
            return (delta if residual is None else delta + residual), None
        n = delta.numel()
        block, chunk = self.quantizer.layout(n, 1)
        padded = delta.new_zeros(chunk, dtype=torch.float32)
        padded[:n] = delta.detach()
        if residual is not None:
            padded[:n] += residual
        message, decoded = self.quantizer.encode_with_values(padded.unsqueeze(0), block)
        if residual is None:
            return message[0], None
        lost = padded[:n] - decoded[0, :n]
        return message[0], lost if torch.isfinite(lost).all() else torch.zeros_like(lost)

    def mean(self, gathered: torch.Tensor, n: int) -> tuple[torch.Tensor, list[bool]]:
        """The fp32 mean of the decoded messages over the workers that sent one, and which rows
        (ranks) it took: an adopter's empty message (all zero bytes, ``InFlight.adopted``) is left
        out, and so is a row the norm check leaves out. A real 4- or 8-bit message is never all
        zero bytes (its scales are not zero unless its values are, and int4 codes zero as 8),
        nor, in practice, an fp32 vector. On the messages' device."""
        sent = gathered.reshape(gathered.shape[0], -1).ne(0).any(dim=1)
        if self.quantizer is not None:
            block, chunk = self.quantizer.layout(n, 1)
            gathered = self.quantizer.decode(gathered, chunk, block)[:, :n]
        if self.comm.checking:  # the norm check on the decoded messages: no communication
            judged = self.comm.weigh_gathered([message_norm(row) for row in gathered])
            weights = torch.tensor(judged, device=gathered.device)
            sent &= weights > 0
            gathered = gathered * weights.unsqueeze(1)  # 0 * NaN is NaN: left-out rows are dropped below
        return gathered[sent].sum(dim=0) / max(1, int(sent.sum())), sent.tolist()
