"""The check of contributions to an average, mixed into ``Communicator`` (``CheckedMeans``).

With ``max_norm_ratio`` (or an ``aggregate`` other than the plain mean) every mean leaves out
the contributions ``comm.guard`` rejects (not finite, or a norm too far above the others'
median); ``clip`` also scales each one down to the median norm, ``trimmed`` and ``median`` take a
coordinate-wise statistic of the kept ones. A plain mean over one flat group learns the verdict
alongside the average (``_checked_mean``: the table of norms travels with the contributions);
the others wait for it before their collective (``_screen``). Codecs whose collective is not a
mean all-reduce judge through ``screen``, ``check_shards`` and ``weigh_gathered``. Verdicts are
counted by host, for ``--max-rejections``. ``corrupt_`` (``--chaos corrupt``) spoils a
contribution as a broken or hostile worker would. The rules themselves are ``comm/guard.py``'s.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.guard import Verdict, clip_norm, judge, message_norm, robust_mean
from geotrain.comm.waits import Handle


def corrupt_(tensor: torch.Tensor, how: str) -> None:
    """Chaos (``--chaos corrupt``): spoil a contribution in place, as a broken or hostile worker
    would: ``nan``, ``inf``, ``signflip`` or ``scale=X``."""
    with torch.no_grad():
        if how in ("nan", "inf"):
            tensor.fill_(float(how))
        elif how == "signflip":
            tensor.neg_()
        elif how.startswith("scale="):
            tensor.mul_(float(how.partition("=")[2]))
        else:
            raise ValueError(f"unknown corruption {how!r}; accepted: nan, inf, signflip, scale=X")


# Verdicts update the counts --max-rejections reads; DDP's buckets are judged on threads of their
# own. One lock for the process: a communicator is copied with its state (no lock to pickle).
_JUDGING = threading.Lock()


class CheckedMeans:
    """The check's part of ``Communicator``, which inherits it: a mixin with no fields and no
    ``__init__``, so the dataclass is as it was. It uses the communicator's fields and state
    (``group``, ``world_size``, ``rank``, ``membership``, ``max_norm_ratio``, ``_aggregate``,
    ``_trim``, ``left_out``, ``corrupt_next``, ``rejected_by_rank``, ``disputed_shards``,
    ``stamp_strays``, ``step_checked``, ``step_rejected``, ``_spare_buffers``, ``stats``,
    ``control_calls``, ``min_collective_s``)
    and its collectives (``_launch_sum``, ``_wait``, ``all_gather``)."""

    # The hosts, by rank, of the group whose rows are being judged, where that is not this
    # group (``judging_rows_of``); None: this group's.
    _rows_hosts: tuple[int, ...] | None = None
    # Whether the verdicts now taken are a landing's of a message in flight (``judging_a_landing``)
    _at_landing: bool = False

    def ratio_for(self, workers: int) -> float:
        """The norm ratio that applies among ``workers``: under ``--max-norm-ratio auto``
        (``auto_min_workers``) the one asked for from that many on; below it a ratio cannot say
        which of two is wrong, but what is not finite is wrong wherever it comes from: a ratio
        of inf leaves out only that."""
        if not self.auto_min_workers:
            return self.max_norm_ratio
        few = math.inf if self._wanted_ratio > 0 and workers > 1 else 0.0
        return self._wanted_ratio if workers >= self.auto_min_workers else few

    @contextlib.contextmanager
    def judging_a_landing(self):
        """The verdicts taken inside are a landing's of a message launched at an earlier sync
        (SparseLoCo's, CO2's: ``InFlight.rows_judged``), which a regroup keeps where a survivor
        landed it before a failure (another lands it from that survivor's result, and judges it
        too): they count in the step, where the rest of a step cut short is redone and judged
        again (``forget_cut_verdicts``)."""
        previous, self._at_landing = self._at_landing, True
        try:
            yield
        finally:
            self._at_landing = previous

    def forget_cut_verdicts(self) -> None:
        """A regroup's first act: the verdicts of the step a failure cut short are dropped, but
        a landing's (``judging_a_landing``). Survivors cut short at different collectives of the
        step had judged different ones, and each redoes them; counted too, one survivor's
        rejections in a row would run one ahead of another's (``--max-rejections``: a split
        vote to drop a host)."""
        self.step_checked = set(self.landing_checked)
        self.step_rejected = set(self.landing_rejected)

    def take_step_verdicts(self) -> tuple[set[int], set[int]]:
        """The hosts this step's checks judged, and those they rejected (``--max-rejections``
        counts them per step); the counts start again for the next step."""
        taken = self.step_checked, self.step_rejected
        self.step_checked, self.step_rejected = set(), set()
        self.landing_checked, self.landing_rejected = set(), set()
        return taken

    def _checked(self, host: int) -> None:
        self.step_checked.add(host)
        if self._at_landing:
            self.landing_checked.add(host)

    @contextlib.contextmanager
    def judging_rows_of(self, hosts: tuple[int, ...] | list[int]):
        """Judge gathered rows (``weigh_gathered``) that another group's collective gave, one
        from each of ``hosts`` in that group's rank order: a result kept at a regroup from the
        group before, or landed by another survivor and sent on (``InFlight.rows_judged``). Each
        rejection counts against the host that sent the row, as it did on the workers that
        landed it in that group, and this group's ``left_out`` ranks (not those rows') apply
        to none of them. They are judged at the ratio of their group's size (under
        ``--max-norm-ratio auto`` a group of two judges only finiteness, where the three that
        sent them were judged by the ratio), so every worker weighs them alike."""
        previous = self._rows_hosts, self.max_norm_ratio
        self._rows_hosts, self.max_norm_ratio = tuple(hosts), self.ratio_for(len(hosts))
        try:
            yield
        finally:
            self._rows_hosts, self.max_norm_ratio = previous

    def _in_band(self, op: str) -> bool:
        """Whether a checked mean learns the verdict alongside the average (``_checked_mean``)
        rather than before it (``_screen``): a plain mean over one flat group. Clipping scales a
        contribution before it is sent, and a robust mean gathers instead of summing."""
        return op == "mean" and self._aggregate == "mean" and self.world_size > 1

    def _norm_table(self, tensor: torch.Tensor) -> torch.Tensor:
        """This worker's row of the check's table: its contribution's norm and whether it is
        finite (float64, on the tensor's device: NCCL reduces only there). A NaN or an inf
        anywhere makes the norm one, so the norm alone says the tensor is finite: the scan for
        them (12x the norm's time on a CPU) runs only where it does not, to tell a norm that
        overflowed float32 (values above 1e19) from a tensor that is not finite."""
        values = tensor.detach()
        norm = float(torch.linalg.vector_norm(values, dtype=torch.float32))
        finite = math.isfinite(norm)
        if not finite and bool(torch.isfinite(values).all()):
            norm, finite = float(torch.linalg.vector_norm(values, dtype=torch.float64)), True
        table = torch.zeros(self.world_size, 2, dtype=torch.float64, device=tensor.device)
        table[self.rank, 0] = norm if finite else 0.0
        table[self.rank, 1] = 1.0 if finite else 0.0
        return table

    def _checked_mean(self, tensor: torch.Tensor, nbytes: int) -> Handle:
        """A checked mean with no round trip before it: the table of norms (``_norm_table``)
        travels with the contributions, so a mean waited for inside backward (ssgd's and
        DreamDDP's buckets, a warm start's steps) costs no more latency than an unchecked one.
        A float32 or float64 message carries it in the same all-reduce, its 2 N last values
        (each worker writes its own row, the others are zeros: the sum is the table); a message
        in 16 bits, whose range a norm would overflow, sends it in a float64 all-reduce of its
        own, beside. When the verdict keeps every contribution, as it does but for a broken or
        hostile worker, the sum is the mean's. When it leaves one out, the sum is spoiled (a NaN
        cannot be subtracted, nor a 1e6-scaled vector without losing bits), so the mean is taken
        again from this worker's contribution (the message itself, left as it was while its copy
        travelled; or a copy kept for it), the rejected ones zeroed: bitwise what ``_screen``'s
        path gives. Every worker reaches the same verdict, so every one takes it again, in the
        order it waits (``Handle.redo`` where that wait is on another thread: DDP's buckets)."""
        out, w, n = self.left_out, self.world_size, tensor.numel()  # ``out``: as sent
        sent = tensor.detach()
        row = self._norm_table(sent if self.rank not in out else sent.new_zeros(1))
        together = tensor.dtype in (torch.float32, torch.float64)
        launched = time.perf_counter()
        self.control_calls += 1
        own: list[torch.Tensor] = []
        if together:
            buf = self._take_buffer(n + 2 * w, tensor.dtype, tensor.device)
            data, table = buf[:n], buf[n:].view(w, 2)
            if self.rank in out:
                data.zero_()  # a copy of the leader's state (``leaving_out``): it weighs nothing
            else:
                data.copy_(sent.reshape(-1))
            table.copy_(row)
            works = [self._launch_sum(buf, nbytes)]
        else:
            own.append(sent.clone())  # what the mean is taken again from, if it must be
            if self.rank in out:
                tensor.zero_()
            data, table = sent, row
            works = [dist.all_reduce(row, op=dist.ReduceOp.SUM, group=self.group, async_op=True)]
            works.append(self._launch_sum(tensor, nbytes))
        handle = Handle(self, works, tensor, 1, launched, "all-reduce", nbytes)

        def finish() -> None:
            verdict = self._judge_table(table.tolist(), out)
            if verdict.count == w - len(out):
                if together:
                    tensor.copy_(data.view_as(tensor))
                    self._give_back(buf)
                tensor.div_(verdict.count)
                own.clear()
                return
            if verdict.count == 0:  # nothing to average: every worker keeps its own (as it was)
                if together:
                    self._give_back(buf)
                else:
                    tensor.copy_(own.pop())
                return
            mine = data if together else own.pop()
            if not verdict.kept[self.rank]:
                mine.zero_()
            elif together:
                mine.copy_(sent.reshape(-1))

            def redo() -> torch.Tensor:
                self._wait_blocked(self._launch_sum(mine, nbytes), time.perf_counter(), nbytes)
                tensor.copy_(mine.view_as(tensor)).div_(verdict.count)
                if together:
                    self._give_back(buf)
                handle.redo = None  # once: a second call would give the buffer back twice
                return tensor

            if handle.defer_redo:
                tensor.zero_()  # not the spoiled sum, until ``handle.redo()`` writes the mean
                handle.redo = redo
            else:
                redo()

        handle._finish = finish
        return handle

    def _take_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``numel`` values: one a finished checked mean gave back, or a new one.
        Each mean in flight holds its own, so the buckets of one step never share one. Kept on
        the CPU only: what they save is the kernel's page faults, and a GPU's caching allocator
        reuses its memory already (a kept one would be held through the forward pass)."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        spare = self._spare_buffers.get((numel, dtype, device))
        if spare:
            with contextlib.suppress(IndexError):  # DDP's hook thread may take the last one first
                return spare.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def _give_back(self, buffer: torch.Tensor) -> None:
        """``buffer``'s collective is done and its values copied out: the next mean of its size
        takes it (``_take_buffer``)."""
        if buffer.device.type != "cpu":
            return
        self._spare_buffers.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)

    def _robust_mean(self, tensor: torch.Tensor, kept_ranks: list[bool], launched: float) -> Handle:
        """``--aggregate trimmed|median``: every contribution gathered, the same coordinate-wise
        statistic computed over the kept ones on every worker, written into ``tensor``."""
        flat = tensor.detach().reshape(-1)
        gathered = self.all_gather(flat, async_op=True)
        kept = torch.tensor(kept_ranks)

        def finish() -> None:
            rows = gathered.wait()[kept]
            tensor.copy_(robust_mean(rows, self._aggregate, self._trim).view_as(tensor))

        return Handle(self, None, tensor, 1, launched, finish=finish)

    def _screen(self, tensor: torch.Tensor) -> Verdict:
        """Before a mean all-reduce (``max_norm_ratio``): every worker's norm and finiteness,
        the same verdict everywhere (``comm.guard.judge``); a contribution left out is zeroed
        in place here. Returns the verdict (its count: the mean's divisor)."""
        table = self._norm_table(tensor)
        self.control_calls += 1
        start = time.perf_counter()  # waiting for the verdict is communication not hidden
        work = dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait_blocked(work, start, table.numel() * 8)
        rows = table.tolist()
        verdict = self._judge_table(rows, self.left_out)
        if verdict.count == 0:
            return verdict
        if self._aggregate == "clip" and verdict.kept[self.rank]:
            limit, norm = clip_norm([r[0] for r in rows], verdict.kept), rows[self.rank][0]
            if norm > limit:
                tensor.mul_(limit / norm)
        if not verdict.kept[self.rank]:
            tensor.zero_()
        return verdict

    def _wait_blocked(self, work, start: float, nbytes: int) -> None:
        """Wait for an all-reduce launched at ``start``, at least a round trip on links with
        software latency, and count the wait as blocked communication."""
        self._wait(work, "all-reduce", nbytes)
        remaining = start + self.min_collective_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self.stats.blocked_s += time.perf_counter() - start

    def _judge_table(self, rows: list[list[float]], out: frozenset[int]) -> Verdict:
        """``_judge`` on the check's summed table: a (norm, finite) row per rank."""
        return self._judge([r[0] for r in rows], [r[1] > 0.5 for r in rows], out)

    def _judge(self, norms: list[float], finite: list[bool], out: frozenset[int] | None = None) -> Verdict:
        """``comm.guard.judge`` on the group's contributions (rank order), counted by host, and
        this worker told where its own is left out. The ``left_out`` ranks (``out``: as they
        were when the contributions were sent) are left out as they are, neither judged (nor in
        the others' median) nor counted as rejected. Under a lock: DDP's buckets are judged on
        threads of their own, and the counts feed ``--max-rejections``."""
        with _JUDGING:
            return self._judge_locked(norms, finite, self.left_out if out is None else out)

    def _judge_locked(self, norms: list[float], finite: list[bool], out: frozenset[int]) -> Verdict:
        theirs = self._rows_hosts is not None  # another group's rows (``judging_rows_of``)
        out = out if len(norms) == self.world_size and not theirs else frozenset()
        norms = [0.0 if r in out else n for r, n in enumerate(norms)]  # 0: not in any median
        finite = [True if r in out else f for r, f in enumerate(finite)]
        verdict = judge(norms, finite, self.max_norm_ratio)
        for r in out:
            verdict.kept[r], verdict.reasons[r] = False, "left out: a copy of the leader's state"
        for r, kept in enumerate(verdict.kept):
            if r in out:
                continue
            self._checked(self._host(r))
            if not kept:
                self._rejected(r)
        if verdict.count and not theirs and not verdict.kept[self.rank] and self.rank not in out:
            print(
                f"geotrain: this worker's contribution to an average was left out "
                f"({verdict.reasons[self.rank]}; --max-norm-ratio {self.max_norm_ratio:g})",
                file=sys.stderr,
                flush=True,
            )
        return verdict

    # -- the check, for codecs whose collective is not a mean all-reduce -------------------------
    @property
    def checking(self) -> bool:
        """Whether contributions are checked before they are averaged (``max_norm_ratio``, or an
        ``aggregate`` other than the plain mean)."""
        return self.max_norm_ratio > 0 or self._aggregate != "mean"

    @property
    def screening(self) -> bool:
        """Whether some contribution may be kept out of the average under way: checked, or a
        copy ``leaving_out`` leaves out. Codecs judge (``screen``, ``weigh_gathered``) where so."""
        return self.checking or bool(self.left_out)

    @property
    def aggregate_kind(self) -> tuple[str, int]:
        """``--aggregate`` parsed: (mean | clip | trimmed | median, f)."""
        return self._aggregate, self._trim

    def spoiled(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``--chaos corrupt`` for a codec that encodes before it sends: a corrupted copy of
        ``tensor`` where a corruption is due (None otherwise). The codec sends the copy and keeps
        its own state (error feedback, momentum) clean, as a worker whose message was spoiled on
        the way would."""
        if not self.corrupt_next or not tensor.is_floating_point():
            return None
        copy = tensor.detach().clone()
        corrupt_(copy, self.corrupt_next)
        self.corrupt_next = ""
        return copy

    def screen(self, tensor: torch.Tensor) -> Verdict | None:
        """The check before a codec's own collective (a reduce-scatter of quantised rows): the same
        verdict on every worker, ``tensor`` zeroed here where this worker's is left out (scaled
        down with ``clip``). None where nothing is checked."""
        if self.world_size == 1 or not self.screening:
            return None
        if not self.checking:  # only copies left out: no norms to exchange
            if self.rank in self.left_out:
                tensor.zero_()
            kept = [r not in self.left_out for r in range(self.world_size)]
            return Verdict(kept, ["" if k else "left out" for k in kept])
        return self._screen(tensor)

    @property
    def judges_rows_in_band(self) -> bool:
        """Whether a codec that sends one row of its message to each worker (the quantised
        codecs' all-to-all) sends its norm with them (``norm_bytes``) and judges on arrival
        (``judge_rows``), with no round trip before: checked, and not clipped (clipping scales a
        contribution before it is sent, so its verdict must come first)."""
        return self.world_size > 1 and self.checking and self._aggregate != "clip"

    def norm_bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        """This worker's row of the check's table (its contribution's norm and whether it is
        finite, float64) as 16 bytes on ``tensor``'s device, for a codec to append to each row
        it sends: every worker then holds every worker's row. A copy ``left_out`` leaves out
        sends a zero norm (it is left out as such, neither judged nor counted)."""
        out = self.rank in self.left_out
        return self._norm_table(tensor.new_zeros(1) if out else tensor)[self.rank].view(torch.uint8)

    @staticmethod
    def finite_in(norm_bytes: torch.Tensor) -> bool:
        """Whether the contribution ``norm_bytes`` describes was finite (what every worker's
        verdict will say of it, whatever the ratio)."""
        return bool(norm_bytes.view(torch.float64)[1] > 0.5)

    def judge_rows(self, rows: torch.Tensor, out: frozenset[int]) -> Verdict:
        """The verdict on the rows ``norm_bytes`` made, one from each worker in rank order
        ((world, 16) uint8, as received), the same on every worker; ``out``: the ``left_out``
        ranks when they were sent. No communication."""
        table = rows.contiguous().view(torch.float64).reshape(self.world_size, 2).tolist()
        return self._judge_table(table, out)

    def group_hosts(self) -> tuple[int, ...] | None:
        """This group's hosts by rank, where known (ranks change at a regroup)."""
        members = getattr(self.membership, "members", None)
        return tuple(members) if members and len(members) == self.world_size else None

    def _host(self, rank: int) -> int:
        """The host of a group rank, where hosts are known; of the rows' group where they are
        another's (``judging_rows_of``). (Rows of a bigger group with no hosts known, a result
        restored from a state saved without them, are counted by rank.)"""
        hosts = self._rows_hosts if self._rows_hosts is not None else self.group_hosts()
        return hosts[rank] if hosts and rank < len(hosts) else rank

    def _rejected(self, rank: int) -> None:
        """Count a contribution of ``rank`` left out by the check (``rejected_updates``)."""
        host = self._host(rank)
        self.rejected_by_rank[host] = self.rejected_by_rank.get(host, 0) + 1
        self.step_rejected.add(host)
        if self._at_landing:
            self.landing_rejected.add(host)

    def check_shards(
        self, shards: torch.Tensor, verdict: Verdict, bound: float | None = None
    ) -> torch.Tensor:
        """The second phase of a sharded average (the quantised codecs: each worker averages one
        shard of every kept contribution, re-quantises it and all-gathers it): ``shards`` (one
        row per worker, decoded from the same bytes everywhere) checked against the bound the
        first phase's norms set (``Verdict.shard_bound``: 10 times what the kept contributions
        allow, whatever ``max_norm_ratio``). A shard that is not finite, or whose norm is above
        it, is zeroed (that part of the model gets no average this time, on every
        worker alike) and counted as its owner's rejection. ``bound``: the one the owners agreed
        on (``guard.agreed_shard_bound``, where each worker's verdict came from the rows it
        received: a sender that sent different workers different norms would otherwise have
        them check the same shard against different bounds). No communication."""
        if not verdict.norms:
            return shards
        bound = verdict.shard_bound() if bound is None else bound
        for r in range(shards.shape[0]):
            norm, finite = message_norm(shards[r])
            if finite and norm <= bound:
                continue
            shards[r].zero_()
            self._rejected(r)
            host = self._host(r)
            said = f"{norm:.3g} > {bound:.3g}, what the contributions allow" if finite else "not finite"
            print(
                f"geotrain: host {host}'s shard of an average was left out (its norm {said})",
                file=sys.stderr,
                flush=True,
            )
        return shards

    def compare_shards(
        self, shards: torch.Tensor, second: torch.Tensor, offset: int, same_inputs: list[bool]
    ) -> list[int]:
        """A quantised codec's second phase with two owners per shard (``owners=2``): ``shards``
        and ``second`` (row j: shard j's bytes from its owner, and from its second owner, worker
        j + ``offset``), the same on every worker. Returns the shards whose copies differ, each
        counted for its pair of owners (``disputed_shards``) and said on stderr: one pair cannot
        say which of the two is wrong, so neither is counted as rejected here (``--max-rejections``
        would otherwise let a hostile owner have an honest one dropped); a run of disputes can
        (``blame_owner``). ``same_inputs``: per shard, whether both copies were computed from the
        same inputs (their digests agree), which the message says. No communication."""
        differs = (shards != second).any(dim=1).tolist()
        disputed = [j for j, d in enumerate(differs) if d]
        for j in disputed:
            pair = (self._host(j), self._host((j + offset) % self.world_size))
            self.disputed_shards[pair] = self.disputed_shards.get(pair, 0) + 1
            if same_inputs[j]:
                why = "from the same inputs: one of them is broken or hostile"
            else:
                why = "from different inputs: a sender, or one of them, is broken or hostile"
            print(
                f"geotrain: hosts {pair[0]} and {pair[1]} computed different copies of shard {j} of an "
                f"average; that shard was left out ({why})",
                file=sys.stderr,
                flush=True,
            )
        return disputed

    def blame_owner(self, rank: int, partners: list[int]) -> None:
        """An owner that disputed with two or more others over copies of shards, each of whom
        disputed only with it (``compress.owners.blame_disputes``): counted as its rejection, so that
        ``--max-rejections`` drops a worker that keeps spoiling what it computes. Every worker
        counts it alike (the same disputes). No communication."""
        others = " and ".join(str(self._host(p)) for p in partners)
        self._blame(rank, f"disagreed with hosts {others} over copies of the same shards, each of whom "
                    "disputed with no one else")  # fmt: skip

    def count_strays(self, stream: Any, strays: list[int]) -> None:
        """Owners that sent their copies of a stream's shards under another owners' stamp than a
        strict majority (``compress.owners``): an honest worker does so at most once per stream
        between two regroups (a joiner, a rebuilt host, a failed message: each comes with one), so
        from the second time on it is counted as a rejection. The record (``stamp_strays``) is
        begun again at every regroup (``rebind``) and is never saved, so a resumed run, whose
        members start afresh, counts nobody's past. Every worker counts alike (the same stamps)."""
        seen = self.stamp_strays.setdefault(stream, set())
        why = (
            "sent its copies of shards under another owners' state than most workers again since the "
            "members last changed (an honest worker differs at most once)"
        )
        for r in strays:
            if r in seen:
                self._blame(r, why)
            seen.add(r)

    def _blame(self, rank: int, why: str) -> None:
        """Count ``rank``'s contribution as rejected for what a run of its messages showed, and say
        why (``--max-rejections`` counts it as a step checked)."""
        self._rejected(rank)
        self._checked(self._host(rank))
        print(
            f"geotrain: host {self._host(rank)} {why}: counted as its rejected contribution",
            file=sys.stderr,
            flush=True,
        )

    def weigh_gathered(self, judged: list[tuple[float, bool]]) -> list[float]:
        """The check on contributions every worker already holds (an all-gather's messages,
        decoded; ``judged``: each one's ``guard.message_norm``, in rank order), with no
        communication: each one's weight in the mean. 0 where it is left out, else 1, or with
        ``clip`` the factor that brings it down to the median norm. Every worker computes the
        same weights from the same messages."""
        if not self.checking or len(judged) < 2:
            return [0.0 if r in self.left_out else 1.0 for r in range(len(judged))]
        norms, finite = [n for n, _ in judged], [ok for _, ok in judged]
        verdict = self._judge(norms, finite)
        limit = clip_norm(norms, verdict.kept) if self._aggregate == "clip" else float("inf")
        return [
            (min(1.0, limit / norm) if norm > 0 else 1.0) if kept else 0.0
            for norm, kept in zip(norms, verdict.kept, strict=True)
        ]
