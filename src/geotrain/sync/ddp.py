"""``ddp``: PyTorch ``DistributedDataParallel`` itself, the reference users run today.

Bytes are accounted from the gradient sizes (DDP all-reduces every gradient every step); the time
DDP waits for its all-reduces happens inside ``backward`` and cannot be told apart from compute,
so this algorithm reports no blocked-communication time.

With ``compress``, a DDP communication hook averages each bucket with that codec, under backward
as ``ssgd`` does: the hook launches the bucket's first collective and returns a future that is
not yet done; a codec of two phases (int8's all-to-all, then the all-gather of the re-quantised
shards) has the bucket launched ``ADVANCE_DEPTH`` hooks earlier advanced before the next is
launched; the last bucket's hook advances the rest, waits for every mean and completes the
futures, which DDP then reads. DDP calls its hooks in bucket order, so every worker issues its
collectives in one order.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from operator import itemgetter

import torch
from torch.nn.parallel import DistributedDataParallel

from geotrain.comm.buckets import Pending, advance_behind, wait_all
from geotrain.ft.membership import retire
from geotrain.plan.cost import ADVANCE_DEPTH
from geotrain.sync.base import SyncAlgorithm, SyncConfig, require

# DDP's own broadcast of every parameter at construction, off where this torch can turn it off
# (``init_sync``, torch >= 2.6): SyncAlgorithm compares digests and moves only what differs.
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters
NO_INIT_SYNC = {"init_sync": False} if "init_sync" in _DDP_ARGS else {}


@dataclass
class DDPConfig(SyncConfig):
    bucket_mb: float = 25.0  # DDP's own default
    compress: str = ""  # a codec spec (geotrain.compress); "": DDP's own all-reduce

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"bucket_mb must be > 0 (a size in MB), got {self.bucket_mb}")


class DDP(SyncAlgorithm):
    name = "ddp"
    measures_blocked_time = False

    def __init__(self, model, optimizer, comm, config: DDPConfig | None = None) -> None:
        super().__init__(model, optimizer, comm, config or DDPConfig())
        self._wrap()

    def _wrap(self) -> None:
        model, comm = self.module, self.comm
        self._ddp = None
        if comm.world_size > 1:
            # Not DDP's own broadcast of every parameter (frozen ones too, and again at each
            # regroup): ours (in super) compares digests and moves them only where they differ,
            # and a regroup hands the state over before it rebinds.
            # Buckets keep their first layout, so a resume goes on bitwise. Otherwise DDP takes
            # its first step with the whole model in one bucket and then rebuilds its buckets by
            # the order gradients came ready: a resumed run's first step would place each
            # gradient elsewhere in its bucket than the uninterrupted run's step did, and a ring
            # all-reduce among more than 2 workers sums an element in an order set by its place
            # (one ULP apart, measured on 4 workers). A codec would also group (and quantise)
            # differently, its residuals no longer matching their streams. DDP never rebuilds
            # when it looks for unused parameters; the search costs a walk of the autograd graph
            # and a few hundred bytes a step (no step time measurable on mini, 4 workers).
            self._ddp = DistributedDataParallel(
                model,
                process_group=comm.group,
                bucket_cap_mb=self.config.bucket_mb,
                find_unused_parameters=True,
                **NO_INIT_SYNC,
            )
        self._grad_tensors = [p for p in self.parameters()]
        self._handles: dict = {}  # this step's buckets through the Communicator, by index
        # This step's codec means in flight, in launch order: (mean, DDP's future, bucket buffer)
        self._in_flight: list[tuple[Pending, torch.futures.Future, torch.Tensor]] = []
        # Through the Communicator also with sites: its all-reduce goes in two levels.
        # And with the norm check, which judges every bucket as it is averaged.
        through_comm = comm.membership is not None or comm.two_level is not None or comm.checking
        self._interruptible = self._ddp is not None and self.codec is None and through_comm
        if self.codec is not None and self._ddp is not None:
            self._ddp.register_comm_hook(None, self._codec_hook)
        elif self._interruptible:
            # --on-failure continue: DDP's own all-reduce waits inside backward, where no new
            # membership can reach it (a peer cut off sends no reset: it would wait until the
            # group's timeout). The same all-reduce through the Communicator, finished by a
            # thread whose wait gives up when the coordinator publishes a new epoch.
            self._ddp.register_comm_hook(None, self._interruptible_hook)

    def _codec_hook(self, _state, bucket):  # no annotation: DDP checks it against a runtime type
        grads = bucket.gradients()  # views into bucket.buffer(): the mean lands in the buffer
        # The key includes the layout: a bucket is known by its place and its gradients.
        key = ("ddp", bucket.index(), tuple(tuple(g.shape) for g in grads))
        advance_behind(self._in_flight, ADVANCE_DEPTH, itemgetter(0))
        future: torch.futures.Future = torch.futures.Future()
        self._in_flight.append((self.codec.reduce(self.comm, key, grads), future, bucket.buffer()))
        if bucket.is_last():  # DDP reads the futures once backward is done: have them done by then
            self._land_codec_means()
        return future

    def _land_codec_means(self) -> None:
        """Every codec mean of this step into its bucket's buffer (the second phases advanced
        the last launched first, as ``ssgd`` and the cost model do), then DDP's futures done."""
        in_flight, self._in_flight = self._in_flight, []
        try:
            wait_all([mean for mean, _, _ in reversed(in_flight)])
        except BaseException as e:  # raised from backward; the reducer is replaced by rebind
            for _, future, _ in in_flight:
                future.set_exception(e)
            raise
        for _, future, buffer in in_flight:
            future.set_result(buffer)

    def _interruptible_hook(self, _state, bucket):  # no annotation: DDP checks its runtime type
        buffer = bucket.buffer()
        handle = self.comm.all_reduce(buffer, op="mean", async_op=True)
        # A mean the norm check must take again is taken by ``before_step`` on the training
        # thread, in bucket order: from these threads it could cross later buckets' launches.
        handle.defer_redo = True
        # Where each gradient lies in the buffer (DDP lays a view out with its parameter's
        # strides), for the mean taken again; a later backward's bucket replaces an earlier one's.
        start = buffer.storage_offset()
        places = [(g.size(), g.stride(), g.storage_offset() - start) for g in bucket.gradients()]
        self._handles[bucket.index()] = (handle, bucket.parameters(), places)
        future: torch.futures.Future = torch.futures.Future()

        def finish() -> None:
            try:
                handle.wait()
                future.set_result(buffer)
            except BaseException as e:  # noqa: BLE001 - DDP raises it from backward
                future.set_exception(e)

        threading.Thread(target=finish, name="geotrain-ddp-bucket", daemon=True).start()
        return future

    def rebind(self) -> None:
        # A reducer is bound to its group for life: a new wrapper for the new epoch's group. The
        # old one is kept, never freed (see ``ft.membership.RETIRED``), and its reducer's hooks
        # on the parameters are removed so that it does nothing more.
        if self._ddp is not None:
            self._ddp.reducer._remove_autograd_hooks()
            retire(self._ddp)
        self.close()
        self._wrap()

    @property
    def model(self):
        return self._ddp if self._ddp is not None else self.module

    def before_step(self) -> None:
        if self.comm.world_size > 1:
            if self.codec is None and not self._interruptible:  # else counted by the communicator
                self.comm.account_external(self._grad_tensors)
            self.syncs += 1
        handles, self._handles = self._handles, {}
        for index in sorted(handles):  # the same order on every worker
            handle, params, places = handles[index]
            if handle.redo is not None:  # the check left a contribution out: the mean again
                mean = handle.redo()
                with torch.no_grad():
                    for p, (size, stride, offset) in zip(params, places, strict=True):
                        p.grad.copy_(mean.as_strided(size, stride, mean.storage_offset() + offset))

    def after_step(self) -> bool:
        super().after_step()
        return self.comm.world_size > 1  # gradients were averaged this step

    def replicated_parts(self) -> set[str]:
        return {"model", "optimizer", "sync"} if self.comm.world_size > 1 else {"sync"}

    def close(self) -> None:
        # Drop the wrapper (and with it the reducer's reference to the process group) now: a
        # process group destroyed later, at interpreter exit, aborts in gloo's teardown.
        self._ddp = None
        self.__dict__.pop("_state", None)  # PowerSGD's hook state holds the group too


@dataclass
class DDPPowerSGDConfig(SyncConfig):
    """PyTorch DDP with its built-in PowerSGD communication hook (Vogels et al. 2019)."""

    rank: int = 4
    start_iter: int = 10  # vanilla all-reduce before this step, as PyTorch recommends
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        require(self.rank >= 1, f"rank (PowerSGD's matrix approximation rank) must be >= 1, got {self.rank}")
        require(self.start_iter >= 2, f"start_iter must be >= 2 with error feedback, got {self.start_iter}")
        require(
            self.min_compression_rate > 0,
            f"min_compression_rate must be > 0, got {self.min_compression_rate}",
        )


class DDPPowerSGD(DDP):
    """``ddp_powersgd``: the peer users would pick for compression today.

    One bucket for the whole model: PyTorch's PowerSGD hook fails on gloo with several buckets
    (a collective size mismatch). Bytes are counted exactly as the hook sends them: P and Q,
    (n + m) * rank values, for each matrix worth compressing, plain all-reduce for the rest.
    With ``--max-norm-ratio`` the bucket is judged before the hook forms its factors (a round
    trip per step); a worker left out sends zeros, so its P and Q add nothing, and the mean is
    rescaled to the workers kept (``_hook_leaving_out``: the error feedback with it).
    """

    name = "ddp_powersgd"

    def __init__(self, model, optimizer, comm, config: DDPPowerSGDConfig | None = None) -> None:
        config = config or DDPPowerSGDConfig()
        SyncAlgorithm.__init__(self, model, optimizer, comm, config)
        self._wrap()

    def _wrap(self) -> None:
        """The wrapper and a fresh PowerSGD state (a new epoch starts its warm-up again)."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        model, comm, config = self.module, self.comm, self.config
        self._ddp = None
        self._grad_tensors = self.parameters()
        if comm.world_size > 1:
            self._ddp = DistributedDataParallel(
                model, process_group=comm.group, bucket_cap_mb=1024.0, **NO_INIT_SYNC
            )
            self._state = powersgd.PowerSGDState(
                process_group=comm.group,
                matrix_approximation_rank=config.rank,
                start_powerSGD_iter=config.start_iter,
                min_compression_rate=config.min_compression_rate,
            )
            self._should_compress = powersgd._should_compress
            self._ddp.register_comm_hook(self._state, self._counting_hook(powersgd.powerSGD_hook))

    def _counting_hook(self, hook):
        def counted(state, bucket):
            comm = self.comm
            comm.account_external_bytes(self._bucket_bytes(state, bucket))
            buffer = bucket.buffer()
            spoiled = comm.spoiled(buffer)  # --chaos corrupt
            if spoiled is not None:
                buffer.copy_(spoiled)
            # The norm check, before the factors are formed from the gradients: a round trip (one
            # bucket, so one per step), a contribution left out zeroed (its P and Q are then 0).
            verdict = comm.screen(buffer)
            if verdict is not None and verdict.count == 0:  # nothing to average: each keeps its own
                kept: torch.futures.Future = torch.futures.Future()
                kept.set_result(buffer)
                return kept
            if verdict is None or verdict.count == comm.world_size:
                return hook(state, bucket)
            return self._hook_leaving_out(hook, state, bucket, verdict)

        return counted

    def _hook_leaving_out(self, hook, state, bucket, verdict):
        """PyTorch's hook on a bucket whose contributions the check did not all keep: the mean
        rescaled from the group's size to the workers kept, and the error feedback kept right.
        The hook's memory is what this worker sent less the mean it got; with the mean rescaled
        afterwards, each kept worker's memory is corrected by the same difference. A worker left
        out takes no part: its memory is set aside for the hook (it would send it unchecked)
        and comes back as it was, as a codec's does for a worker left out."""
        comm, index = self.comm, bucket.index()
        scale = comm.world_size / verdict.count
        compressing = state.iter >= state.start_powerSGD_iter  # else no error feedback this step
        left_out = not verdict.kept[comm.rank] and compressing and state.use_error_feedback
        held = state.error_dict.pop(index, None) if left_out else None

        def finish(done):
            mean = done.value()
            if left_out:
                state.error_dict.pop(index, None)
                if held is not None:
                    state.error_dict[index] = held
            elif compressing and state.use_error_feedback and index in state.error_dict:
                state.error_dict[index].sub_(mean, alpha=scale - 1)
            return mean.mul_(scale)

        return hook(state, bucket).then(finish)

    def _bucket_bytes(self, state, bucket) -> int:
        if state.iter < state.start_powerSGD_iter:
            return bucket.buffer().numel() * bucket.buffer().element_size()
        elements = 0
        for grad in bucket.gradients():
            if grad.ndimension() <= 1:
                elements += grad.numel()
                continue
            rows = grad.shape[0]
            compress, full, low_rank = self._should_compress(
                rows, grad.numel() // rows, state.matrix_approximation_rank, state.min_compression_rate
            )
            elements += low_rank if compress else full
        return elements * 4

    def before_step(self) -> None:
        if self.comm.world_size > 1:
            self.syncs += 1  # bytes were counted by the hook
