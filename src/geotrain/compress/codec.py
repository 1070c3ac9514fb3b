"""The codec interface: how a sync algorithm averages tensors in fewer bytes.

A codec averages a list of tensors across the workers, like a mean all-reduce, but puts fewer
bytes on the wire. Its interface (after hivemind's compression API, extended with the collective
each codec needs):

- ``reduce(comm, key, tensors)`` launches the compressed mean of ``tensors`` across the group and
  returns a ``Pending``; ``Pending.wait()`` writes the mean into ``tensors`` in place. ``key``
  names the message (a bucket, a layer): the codec keeps its state per key, because error
  feedback and warm starts belong to one tensor stream.
- ``wire_bytes(shapes, world_size)``: the bytes this worker will send for one ``reduce`` of
  tensors with these shapes, which the tests compare with what the communicator counted.
- ``state_dict()`` / ``load_state_dict()``: the error-feedback residuals and warm-start factors,
  so a checkpoint resumes compression where it stopped.
- ``settle()`` / ``roll_back()``: the entries every worker must hold equal (a warm-up's count,
  ACP-SGD's turn, the low-rank factors) as the last completed step left them, and back to them
  after a failure, so that survivors that got different distances into a failed sync redo it
  alike (``ft/elastic.py``).

Lossy codecs keep *error feedback* (Seide et al. 2014; Karimireddy et al. 2019): what a worker
failed to send this time is added to what it sends next time, so over many steps nothing is
lost, only delayed. Codecs whose payloads can be summed (fp16, bf16, PowerSGD's and ACP-SGD's
factors) use the all-reduce; quantised ones (int8, int4, sign) use a two-phase all-to-all then
all-gather, the compressed all-reduce of 1-bit Adam, which moves 2 (N-1)/N of the compressed
size like a ring all-reduce; sparse ones (top-k) use an all-gather of values and indices.

``make_codec("acpsgd:rank=4")`` parses a spec; bad names and parameters raise ``ConfigError``
listing what is accepted.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from geotrain.comm.buckets import Pending, mean_async
from geotrain.comm.communicator import Communicator


class ConfigError(ValueError):
    """A codec spec a user can fix; the message says what is accepted."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


Shapes = list[tuple[int, ...]]


def drop_if_not_finite(residual: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Error feedback where the norm check runs: a residual that is not finite is dropped (zeroed,
    in place). The message it came with was not finite, so the check left it out of the average;
    carried on, it would spoil every later message of the stream, each left out in turn, and
    ``--max-rejections`` would drop the worker for one bad step. (The quantised codecs drop a
    left-out message's residual on arrival: ``quantize.py``.) Judged on the sum, which any NaN or
    inf makes non-finite: one pass with no mask, a sixteenth of ``isfinite(...).all()``'s time
    (3.5 ms per million values here, on every message of a per-step codec); a sum that overflows
    float32 drops a residual the check would leave out anyway."""
    if comm.checking and not bool(torch.isfinite(residual.sum())):
        residual.zero_()
    return residual


def ring_bytes(nbytes: int, world_size: int) -> int:
    """What one worker sends in a ring all-reduce (or all-to-all + all-gather) of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size


@dataclass
class Codec(ABC):
    """Base of every codec; subclasses are dataclasses whose fields are the spec's parameters."""

    name: ClassVar[str] = "base"
    # One line for `--help` and error messages.
    summary: ClassVar[str] = ""
    # Whether its streams hold factors every worker must hold equal (the low-rank codecs').
    shares_factors: ClassVar[bool] = False
    # Messages per stream sent uncompressed first, as 1-bit Adam warms up before compressing.
    warmup: int = 0

    def __post_init__(self) -> None:
        self._state: dict[Any, dict[str, torch.Tensor]] = {}
        # Per stream touched since the last ``settle``: copies of its shared entries as they
        # were then (counters and rank-r factors: small).
        self._settled: dict[Any, dict[str, torch.Tensor]] = {}
        require(
            isinstance(self.warmup, int) and self.warmup >= 0,
            f"{self.name}: warmup (uncompressed messages first) must be an integer >= 0, got {self.warmup}",
        )

    def reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        """Launch the compressed mean of ``tensors`` over ``comm``'s group. A worker whose
        contribution the mean leaves out (``Communicator.leaving_out``: a copy of the leader's,
        in an average redone after a regroup) keeps its error feedback as it was: what it would
        have kept of the copy, the leader sends itself."""
        if not (self.warmup or self.shares_factors):  # nothing to roll back: no wrapper per message
            return self._reduce_keeping_feedback(comm, key, tensors)
        self._keep_settled(key)  # what the launch changes (a count, a turn), ``roll_back`` undoes
        pending = self._reduce_keeping_feedback(comm, key, tensors)

        def finish() -> None:
            # A message that lands a step after its launch (DreamDDP's, a step late) changes
            # the factors after a ``settle``: kept first, for a failure of the step it lands in.
            self._keep_settled(key)
            pending.wait()

        return Pending(finish, None if pending.advanced else pending.advance, pending.abandon)

    def _reduce_keeping_feedback(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        if comm.rank in comm.left_out:
            state = self.state(key)
            feedback = {k: v.clone() for k, v in state.items() if _is_feedback(k)}
            try:
                pending = self._launch(comm, key, tensors)
            except BaseException:
                _restore_feedback(state, feedback)
                raise

            def advance() -> None:
                try:
                    pending.advance()
                except BaseException:  # a redo that fails again leaves it as it was, too
                    _restore_feedback(state, feedback)
                    raise

            def finish() -> None:
                try:
                    pending.wait()
                finally:
                    _restore_feedback(state, feedback)

            return Pending(finish, advance, abandon=lambda: _restore_feedback(state, feedback))
        return self._launch(comm, key, tensors)

    def _launch(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        if self.warmup:
            state = self.state(key)
            sent = int(state.get("messages", torch.tensor(0)))
            state["messages"] = torch.tensor(sent + 1)
            if sent < self.warmup:
                return mean_async(comm, tensors)
        return self._reduce(comm, key, tensors)

    @abstractmethod
    def _reduce(self, comm: Communicator, key: Any, tensors: list[torch.Tensor]) -> Pending:
        """The codec's own compressed mean (``reduce`` handles the warm-up)."""

    @abstractmethod
    def wire_bytes(self, shapes: Shapes, world_size: int) -> int:
        """Bytes this worker sends for one ``reduce`` of tensors of ``shapes``."""

    def phase_bytes(self, shapes: Shapes, world_size: int) -> tuple[int, int]:
        """``wire_bytes`` split in two: what the collective ``reduce`` launches sends, and what
        the collective its ``Pending.advance`` launches sends (the planner prices the first
        under backward and the second after it, one latency each: ``plan.cost.priced_for_codec``)."""
        return self.wire_bytes(shapes, world_size), 0

    def info(self) -> str:
        """What the codec decided at run time (for the run summary); "" if nothing."""
        return ""

    def spec(self) -> str:
        # A parameter added after specs were saved (snapshots, plans, profiles compare them)
        # is left out at its default (``metadata={"omit_default": True}``), so the old ones
        # still match.
        params = ",".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if not (f.metadata.get("omit_default") and getattr(self, f.name) == f.default)
        )
        return f"{self.name}:{params}" if params else self.name

    def state(self, key: Any) -> dict[str, torch.Tensor]:
        return self._state.setdefault(key, {})

    def state_dict(self) -> dict[str, Any]:
        """The streams' state: live tensors, as torch's own state dicts hold (a residual is
        updated in place by the next message): copy or save them before it."""
        # Keys as they are (tuples, strings): a resumed run must find each stream's residual
        # under the key it will look it up by.
        return {"spec": self.spec(), "streams": [(k, dict(v)) for k, v in self._state.items()]}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore the streams' state; ``device``: the model's (a snapshot holds it on the CPU)."""
        require(
            state.get("spec") == self.spec(), f"checkpoint codec {state.get('spec')!r} != {self.spec()!r}"
        )
        # counters and the owners' stamps stay on the CPU, where they are read (an int() of a
        # GPU tensor would wait for the device at every message)
        # copies: a residual is updated in place (``ChunkTopK._reduce``), and the caller's dict
        # must not change under it
        self._settled = {}  # what it loads is of a completed step: nothing to roll back to
        self._state = {
            k: {
                name: t.to(device or t.device, copy=True) if t.is_floating_point() else t
                for name, t in v.items()
            }
            for k, v in state["streams"]
        }

    def load_shared_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Take another worker's shared entries (``shared_entries`` of its ``state_dict``),
        keeping this worker's own (its error feedback: a joiner's none, an adopter's as it was)."""
        require(
            state.get("spec") == self.spec(), f"the members' codec {state.get('spec')!r} != {self.spec()!r}"
        )
        self._settled = {}  # what it loads is of a completed step: nothing to roll back to
        for k, entries in state["streams"]:
            self.state(k).update(
                {
                    name: t.to(device or t.device, copy=True) if t.is_floating_point() else t.clone()
                    for name, t in entries.items()
                }
            )

    def settle(self) -> None:
        """This worker's step is complete: what its messages changed of the shared entries
        stays, whatever fails later."""
        self._settled = {}

    def roll_back(self) -> None:
        """A failure cut this worker's step short: its streams' shared entries go back to what
        the last completed step (``settle``) left. Survivors of one failure get different
        distances into a sync: one has launched a message another had not (a count, a turn
        advanced), one has landed a mean another had not (a factor replaced). Redone from where
        each was, ACP-SGD's turns differed (P met Q, a collective of another size, which gloo
        aborts on) or each projected on a factor of its own (replicas that drift apart for
        good), and a warm-up's counts differed (one sent uncompressed where another
        compressed, and the group hung). Error feedback is this worker's own, and stays."""
        for key, before in self._settled.items():
            state = self.state(key)
            for name in [n for n in state if _is_shared(n) and n not in before]:
                del state[name]
            state.update(before)
        self._settled = {}

    def _keep_settled(self, key: Any) -> None:
        if key not in self._settled:
            self._settled[key] = {n: t.clone() for n, t in self.state(key).items() if _is_shared(n)}


def shared_entries(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """Of a codec's ``state_dict``, the entries every worker holds equal (``_is_shared``: the
    warm-up's message count, ACP-SGD's P/Q turn and both low-rank methods' factors); None where
    no stream holds one. A joiner or an adopter must take these from the members: a fresh
    ACP-SGD stream sends P where the members send Q (a collective of another size, which gloo
    aborts on), or projects on its own factor (a replica that drifts off for good), and a fresh
    warm-up sends uncompressed where the members compress."""
    if state is None:
        return None
    streams = [(k, {n: t for n, t in v.items() if _is_shared(n)}) for k, v in state["streams"]]
    streams = [(k, v) for k, v in streams if v]
    return {"spec": state["spec"], "streams": streams} if streams else None


def _is_shared(key: str) -> bool:
    """A codec state entry equal on every worker: the warm-up's message count, ACP-SGD's turn
    ("step") and the low-rank factors "p<i>", "q<i>" (means over the group, or the seeded start).
    Not the owners' stamp and disputes (a worker that holds others is told and they start again:
    ``owners.settle``), nor any residual."""
    return key in ("messages", "step") or (key[:1] in ("p", "q") and key[1:].isdigit())


def _is_feedback(key: str) -> bool:
    """A codec state entry that is this worker's error feedback (not shared factors, counters or
    the server residual of its shard): "residual", and PowerSGD's "e<i>"."""
    return key == "residual" or (key[:1] == "e" and key[1:].isdigit())


def _restore_feedback(state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    """Put the error feedback back as ``saved`` held it, in the layout the call left (a group of
    another size pads the residual otherwise): its first values, the rest zero."""
    for k in [k for k in state if _is_feedback(k) and k not in saved]:
        del state[k]
    for k, old in saved.items():
        new = state.get(k)
        if new is not None and new.shape != old.shape:
            resized = torch.zeros_like(new).reshape(-1)
            m = min(resized.numel(), old.numel())
            resized[:m] = old.reshape(-1)[:m]
            old = resized.view_as(new)
        state[k] = old


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# -- specs --------------------------------------------------------------------------------------
def _registry() -> dict[str, type[Codec]]:
    from geotrain.compress.chunked import ChunkTopK
    from geotrain.compress.lowrank import ACPSGD, PowerSGD
    from geotrain.compress.quantize import BF16, FP16, Int4, Int8, Sign
    from geotrain.compress.sparse import AdaTopK, TopK

    return {c.name: c for c in (FP16, BF16, Int8, Int4, Sign, TopK, AdaTopK, ChunkTopK, PowerSGD, ACPSGD)}


def codec_names() -> list[str]:
    return list(_registry())


def describe_codecs() -> str:
    lines = []
    for name, cls in _registry().items():
        params = ", ".join(f"{f.name}={f.default}" for f in fields(cls))
        lines.append(f"{name}{':' + params if params else ''}  {cls.summary}")
    return "\n".join(lines)


def _convert(cls_name: str, field_name: str, kind: Any, text: str) -> Any:
    kind = {"int": int, "float": float, "bool": bool}.get(kind, kind) if isinstance(kind, str) else kind
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        return kind(text)
    except ValueError:
        raise ConfigError(f"{cls_name}: {field_name}={text!r} is not a valid {kind.__name__}") from None


def make_codec(spec: str) -> Codec:
    """``"name"`` or ``"name:key=value,key=value"`` -> a validated codec."""
    registry = _registry()
    name, _, params = spec.strip().partition(":")
    require(
        name in registry,
        f"unknown codec {name!r}; accepted: {', '.join(registry)} "
        "(e.g. int8, topk:ratio=0.01, acpsgd:rank=4)",
    )
    cls = registry[name]
    kinds = {f.name: f.type for f in fields(cls)}
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, text = item.partition("=")
        require(bool(eq), f"{name}: parameter {item!r} must look like key=value")
        require(
            key in kinds,
            f"{name}: unknown parameter {key!r}; accepted: {', '.join(kinds) or 'none'}",
        )
        values[key] = _convert(name, key, kinds[key], text)
    return cls(**values)
