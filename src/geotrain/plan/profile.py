"""The profiler: per-layer backward times and the link's all-reduce cost, measured for real.

On the real process group and device, a few forward/backward passes time each layer's backward
(from gradient hooks: a layer is done when its last parameter's gradient is accumulated), the
forward pass and one optimizer step (on a throwaway copy, so training state is untouched). The
link is probed with all-reduces of a few sizes and fitted as ``alpha + beta * bytes``. Times are
averaged over workers (the all-reduce's time is the slowest worker's); the profile reports its own
spread. It takes seconds: 1 warm-up and ``reps`` timed passes, 3 message sizes.

Where workers share cores, what they do at once slows each of them. So the steps are timed
with every worker computing, each step ending in a barrier whose wait is the slowest worker's
lead (``sync_wait_s``), and a probe runs backward under all-reduces: how much slower each runs
(``comm_slowdown_in_backward``) and how much backward slows per byte sent
(``interference_s_per_byte``). The cost model prices all three (``plan.cost``).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from geotrain.comm.communicator import TWO_LEVEL_GATHER_BYTES, Communicator
from geotrain.comm.guard import SPARSE_CODECS
from geotrain.plan.codec_time import codec_key, time_codec
from geotrain.plan.cost import MAX_COMM_SLOWDOWN, ComputeModel, LinkModel, guarded_link, unguarded_link
from geotrain.plan.layers import Layer, layer_groups

PROFILE_VERSION = 1
# A start-up probe's steps (sparseloco --H auto, streaming --tau auto): whole steps timed as a
# profile times them, after PROBE_WARMUP untimed: a worker's first steps run slow while their
# memory is first touched (W1, 4 workers on 2 cores: 2.47, 1.72 and 1.25 s, then 1.07-1.22 s;
# after one warm-up the probe took a step for 1.66 s)
PROBE_STEPS = 3
PROBE_WARMUP = 3


def clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` for a profile on ``device``: on a GPU after the device has finished
    what was queued, since kernels (and NCCL's collectives) run behind the CPU, which would
    otherwise time their launches. The steps it times are serialised by it: a profile's, and the
    few training steps DreamDDP observes to plan from (``StepObserver``), not the others."""
    if device.type != "cuda":
        return time.perf_counter

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


def profile_compute(
    model: nn.Module,
    layers: list[Layer],
    loss_fn: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    reps: int = 3,
    barrier: Callable[[], None] | None = None,
    warmup: int = 1,
) -> dict[str, Any]:
    """Time whole steps as a training loop runs them (zero_grad, forward, backward, an optimizer
    step), ``warmup`` untimed and ``reps`` timed, every worker at once after ``barrier``; and within them
    forward, each layer's backward and the optimizer step. The optimizer steps a copy of itself
    over clones of the parameters, so the parameters and the optimizer's state are untouched
    (the forwards draw random numbers and update running statistics, as any forward does);
    gradients are left cleared. The copy and its state (for AdamW, three times the parameters)
    live through the steps: on an accelerator near its memory limit, profile with room for it.

    Where workers share cores (more processes than cores, or cores that are hyperthreads of one)
    a step is slower than its parts timed apart: on W1 (``mini``, 4 workers on 2 cores) the parts
    timed one after another gave 2.506 s against a loop's 2.835 s. Timed within steps taken
    together, they are what a loop's are (``step_s``, ``contention_scale``)."""
    done: dict[int, float] = {}
    owner = {id(p): i for i, layer in enumerate(layers) for p in layer.params}
    now = clock(_device(layers))

    def on_grad(p: torch.Tensor) -> None:
        done[owner[id(p)]] = now()  # the last parameter of a layer sets its time

    if reps < 1 or warmup < 1:
        raise ValueError(
            f"the profile needs a timed step and a warm-up at least (reps, warmup >= 1), got {reps}, {warmup}"
        )
    copy_opt, clones = _optimizer_copy(optimizer)
    hooks: list[Any] = []
    forward, per_layer, totals, updates, steps = [], [[] for _ in layers], [], [], []
    waits: list[float] = []
    try:
        hooks += [p.register_post_accumulate_grad_hook(on_grad) for layer in layers for p in layer.params]
        if barrier is not None:
            barrier()
        for rep in range(reps + warmup):
            t0 = now()
            model.zero_grad(set_to_none=True)
            done.clear()
            t1 = now()
            loss = loss_fn()
            t2 = now()
            loss.backward()
            t3 = now()
            for p, clone in clones:
                clone.grad = p.grad
            copy_opt.step()
            t4 = now()
            if barrier is not None:
                # What a collective after each step waits for: the slowest worker's step. Workers
                # sharing cores finish a step at different times, and a method that averages every
                # step pays the difference every step (``ComputeModel.sync_wait_s``).
                barrier()
                waits.append(now() - t4)
            if rep < warmup:
                continue  # warm-up (and the copy's optimizer state allocated)
            forward.append(t2 - t1)
            totals.append(t3 - t2)
            updates.append(t4 - t3)
            steps.append(t4 - t0)
            order = sorted(done, key=done.get)
            previous = t2
            for i in order:
                per_layer[i].append(done[i] - previous)
                previous = done[i]
            order_seen = order
    finally:
        for h in hooks:
            h.remove()
        del copy_opt, clones
        model.zero_grad(set_to_none=True)
    mean_done = {i: statistics.fmean(per_layer[i]) for i in range(len(layers))}
    return {
        "order": [layers[i].name for i in order_seen],
        "backward_s": {layers[i].name: mean_done[i] for i in range(len(layers))},
        "forward_s": statistics.fmean(forward),
        "backward_total_s": statistics.fmean(totals),
        "backward_cv": statistics.pstdev(totals) / statistics.fmean(totals) if len(totals) > 1 else 0.0,
        "optimizer_s": statistics.fmean(updates),
        "step_s": statistics.fmean(steps),
        # the warm-up's waits left out: its allocations differ from one worker to the next
        "barrier_wait_s": statistics.fmean(waits[warmup:]) if len(waits) > warmup else 0.0,
    }


def time_gather(
    comm: Communicator, nbytes: int, device: torch.device, now: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds of one all-gather of an ``nbytes`` message (zeros), after a small one that opens
    the connections (large enough to take two levels too) and a barrier."""
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    comm.all_gather(payload[:TWO_LEVEL_GATHER_BYTES])
    comm.barrier()
    started = now()
    comm.all_gather(payload)
    return now() - started


def time_all_reduce(
    comm: Communicator, numel: int, device: torch.device, now: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds of one sum all-reduce of ``numel`` fp32 zeros, after a small one that opens the
    connections and a barrier."""
    payload = torch.zeros(numel, dtype=torch.float32, device=device)
    comm.all_reduce(payload[:1024].clone(), op="sum")
    comm.barrier()
    started = now()
    comm.all_reduce(payload, op="sum")
    return now() - started


def probe_step_and_gather(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    comm: Communicator,
    gather: Callable[[], float],
) -> tuple[float, float, float]:
    """The start-up probe of ``sparseloco --H auto`` and ``--tau auto`` (streaming, co2): PROBE_STEPS
    whole steps after PROBE_WARMUP untimed (``profile_compute``: the parameters and the
    optimizer's state untouched), then ``gather()`` (the seconds of one of the run's gathers), on
    every worker at once and outside the step's bytes. Returns a step's compute, its wait at the
    barrier and the gather, each the slowest worker's, so every worker decides alike."""
    with comm.control_traffic():  # measurements, not training
        profile = profile_compute(
            module,
            layer_groups(module),
            loss_fn,
            optimizer,
            reps=PROBE_STEPS,
            warmup=PROBE_WARMUP,
            barrier=comm.barrier,
        )
        seconds = gather()
    compute_s, wait, seconds = comm.max_scalars([profile["step_s"], profile["barrier_wait_s"], seconds])
    return compute_s, wait, seconds


def measure_interference(
    loss_fn: Callable[[], torch.Tensor], comm: Communicator, message_bytes: int, count: int, reps: int = 2
) -> dict[str, float]:
    """Backward alone, and backward with ``count`` back-to-back all-reduces launched as it starts.

    Where workers share cores (or a NIC needs the CPU), communication and backward slow each other:
    backward takes longer, and the all-reduces run slower than on an idle machine. Both are
    measured here, the way a layer-wise schedule overlaps them. Every worker runs the same
    sequence, so the probing all-reduces match across workers.
    """
    plain, contended, comm_times = [], [], []
    bufs = [torch.zeros(message_bytes // 4) for _ in range(count)]
    for rep in range(reps + 1):
        for with_comm in (False, True):
            loss = loss_fn()
            comm.barrier()
            t0 = time.perf_counter()
            handles = [comm.all_reduce(b, async_op=True) for b in bufs] if with_comm else []
            loss.backward()
            elapsed = time.perf_counter() - t0
            for h in handles:
                h.wait()
            if rep:  # rep 0 warms up
                if with_comm:
                    contended.append(elapsed)
                    comm_times.append(time.perf_counter() - t0)
                else:
                    plain.append(elapsed)
    return {
        "plain_s": statistics.fmean(plain),
        "contended_s": statistics.fmean(contended),
        "comm_s": statistics.fmean(comm_times),
        "noise_s": statistics.pstdev(plain),
    }


def slowdown_under_backward(backward_s: float, comm_s: float, idle_s: float) -> float:
    """The all-reduces' slowdown while backward runs (``measure_interference``): launched as a
    backward of ``backward_s`` starts, they ended ``comm_s`` after it, and take ``idle_s`` on an
    idle link. What ran on after backward went at full speed, so the part inside backward did
    the rest of the idle-link work in ``backward_s``. Where what ran on after backward alone
    outlasts their idle-link time (the line underprices them: loopback, a tiny model), none can
    be read: 1. Where little was done inside, bounded by what a run's own fit would accept
    (``MAX_COMM_SLOWDOWN``): one such probe once read 1.3 million."""
    done_in_backward = idle_s - (comm_s - backward_s)
    if comm_s <= backward_s or idle_s <= 0 or done_in_backward <= 0:
        return 1.0
    return min(MAX_COMM_SLOWDOWN, max(1.0, backward_s / done_in_backward))


def _optimizer_copy(
    optimizer: torch.optim.Optimizer,
) -> tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A copy of ``optimizer`` over clones of its parameters, and (parameter, clone) pairs, so
    that timing its steps leaves the real ones put. Only the optimizer is copied: the model may
    carry hooks of a sync algorithm (and its in-flight collectives), which must not be."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    memo = {id(p): p.detach().clone().requires_grad_(p.requires_grad) for p in params}
    return copy.deepcopy(optimizer, memo), [(p, memo[id(p)]) for p in params]


def probe_sizes(layers: list[Layer]) -> list[int]:
    """Message sizes from small to a sustained transfer.

    Small messages ride a shaper's burst allowance (and a NIC's buffers) and see more than the
    sustained rate; an iteration's layer syncs are sustained traffic. So besides a small and the
    largest layer, one probe is a quarter of the model (256 KB to 4 MB).
    """
    largest = min(max(layer.nbytes for layer in layers), 4 * 2**20)
    total = sum(layer.nbytes for layer in layers)
    sustained = min(max(total // 4, 256 * 1024), 4 * 2**20)
    return sorted({16 * 1024, max(16 * 1024, largest), sustained})


BURST_BYTES = 2**20


def profile_link(
    comm: Communicator, sizes: list[int], reps: int = 2, device: torch.device | None = None
) -> dict[str, Any]:
    """Per-message all-reduce time of each size (the slowest worker's), fitted as ``alpha + beta * bytes``.

    Each sample is a run of back-to-back all-reduces of at least ``BURST_BYTES`` in all, timed per
    message: that is how an iteration's layer syncs travel, and it drains a shaper's burst allowance,
    which a lone small message would ride at far above the sustained rate.
    """
    samples = []
    device = device or torch.device("cpu")  # the model's: on a GPU, NCCL's link, not gloo's
    now = clock(device)
    comm.all_reduce(torch.zeros(1024, device=device))  # connection warm-up
    for nbytes in sizes:
        count = max(1, min(16, BURST_BYTES // nbytes))
        tensors = [torch.zeros(nbytes // 4, device=device) for _ in range(count)]
        times = []
        for _ in range(reps):
            comm.barrier()
            t0 = now()
            for h in [comm.all_reduce(t, async_op=True) for t in tensors]:
                h.wait()
            times.append((now() - t0) / count)
        samples.append([nbytes, comm.max_scalars([statistics.median(times)])[0]])
    alpha, beta = fit_link(samples)
    residuals = [abs(alpha + beta * n - s) / s for n, s in samples]
    return {
        "alpha_s": alpha,
        "beta_s_per_byte": beta,
        "samples": samples,
        "max_rel_residual": max(residuals),
        # The trust options the all-reduces were measured with (their cost is in the fit).
        "aggregate": comm.aggregate_kind[0],
        "checked": comm.max_norm_ratio > 0,
    }


def fit_link(samples: list[list[float]]) -> tuple[float, float]:
    """``seconds = alpha + beta * bytes`` by least squares on *relative* error, alpha, beta >= 0.

    Relative error weighs a 16 KB message (latency-bound) as much as a 4 MB one (bandwidth-bound);
    plain least squares would fit the large ones and miss the small by a wide margin.
    """
    xs = [float(n) for n, _ in samples]
    ys = [float(s) for _, s in samples]
    if len(set(xs)) < 2:
        return 0.0, max(0.0, statistics.fmean(ys) / statistics.fmean(xs))
    # minimise sum(((alpha + beta x - y) / y)^2): weighted least squares with weights 1/y^2
    w = [1 / (y * y) for y in ys]
    sw, swx, swy = (
        sum(w),
        sum(wi * x for wi, x in zip(w, xs, strict=True)),
        sum(wi * y for wi, y in zip(w, ys, strict=True)),
    )
    swxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    det = sw * swxx - swx * swx
    alpha = (swxx * swy - swx * swxy) / det
    beta = (sw * swxy - swx * swy) / det
    if alpha < 0 or beta < 0:  # keep the physical meaning: refit the other term alone
        if beta > 0:
            alpha, beta = 0.0, swxy / swxx
        else:
            alpha, beta = swy / sw, 0.0
    return alpha, beta


def build_profile(
    model: nn.Module,
    layers: list[Layer],
    loss_fn: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    comm: Communicator,
    meta: dict[str, Any] | None = None,
    reps: int = 3,
    contention: bool = True,
    codecs: Sequence[str] = (),
    link_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole profile, identical on every worker (times averaged over workers). ``codecs``:
    specs whose encoding and decoding are timed per layer too (``codecs`` in the profile).
    ``link_from``: a profile of this group's links (``profile_for_workers``) whose all-reduce
    line and contention figures are taken as they are: only the compute is measured (a machine
    new to the group), not the link, whose probe takes seconds to minutes on a slow one."""
    with comm.control_traffic():  # a measurement: not in the training's bytes and seconds
        started = time.perf_counter()
        barrier = comm.barrier if comm.world_size > 1 else None
        local = profile_compute(model, layers, loss_fn, optimizer, reps, barrier)
        timed_codecs = time_codecs(layers, comm, codecs) if codecs else {}
        given = None
        if link_from is not None:
            residual = link_from.get("spread", {}).get("link_max_rel_residual", 0.0)
            given = {**link_from["allreduce"], "max_rel_residual": residual}
        order, averaged, link = _shared(local, layers, comm, given)
        n = len(order)
        interference, slowdown, extra = 0.0, 1.0, 0.0
        if link_from is not None:
            interference = float(link_from.get("interference_s_per_byte", 0.0))
            slowdown = float(link_from.get("comm_slowdown_in_backward", 1.0))
            contention = False  # measured on the group's links already: taken with its line
        # Where workers share cores, transfers take CPU from backward and backward from them.
        # (It was off for a while: a worker aborted at exit in CI, "terminate called without an
        # active exception", which leaving the group together in ``launch.dist`` since fixed.)
        if contention and comm.world_size > 1:
            fit = LinkModel(link["alpha_s"], link["beta_s_per_byte"])
            # enough traffic to outlast backward (so its end is observed), in layer-sized messages
            backward_s = averaged[n + 2]
            total = int(min(64 * 2**20, max(256 * 1024, 1.3 * backward_s / max(fit.beta_s_per_byte, 1e-12))))
            count = 8
            message = max(4096, total // count // 4 * 4)
            measured = measure_interference(loss_fn, comm, message, count)
            model.zero_grad(set_to_none=True)
            plain, contended, comm_s, noise = comm.mean_scalars(
                [measured["plain_s"], measured["contended_s"], measured["comm_s"], measured["noise_s"]]
            )
            (comm_s,) = comm.max_scalars([comm_s])
            idle_s = count * fit.time(message)
            extra = contended - plain
            slowdown = slowdown_under_backward(contended, comm_s, idle_s)
            sent_in_backward = count * message * min(1.0, contended / comm_s)
            # below the run-to-run noise it is no measurement: charge nothing
            interference = extra / sent_in_backward if extra > 2 * noise and sent_in_backward > 0 else 0.0
        profile = _profile(order, averaged, link, layers, comm, meta)
        if timed_codecs:
            profile["codecs"] = timed_codecs
        profile["interference_s_per_byte"] = interference
        profile["comm_slowdown_in_backward"] = slowdown
        profile["contention_measured"] = bool(contention and comm.world_size > 1)
        if link_from is not None:
            profile["contention_measured"] = bool(link_from.get("contention_measured", False))
        profile["spread"]["interference_extra_backward_s"] = extra
        profile["profile_s"] = time.perf_counter() - started
        return profile


def _device(layers: list[Layer]) -> torch.device:
    return next((p.device for layer in layers for p in layer.params), torch.device("cpu"))


def time_codecs(layers: list[Layer], comm: Communicator, codecs: Sequence[str]) -> dict[str, Any]:
    """The ``codecs`` entry of a profile: each codec's seconds per layer (``time_codec``, every
    worker at once after a barrier), averaged over workers in one exchange, under the codec's
    key (``codec_key``: each codec once). Collective."""
    barrier = comm.barrier if comm.world_size > 1 else None
    shapes = [[tuple(p.shape) for p in layer.params] for layer in layers]
    timed = {
        key: time_codec(spec, shapes, comm.world_size, 1, _device(layers), barrier)
        for key, spec in {codec_key(spec): spec for spec in codecs}.items()
    }
    flat = iter(comm.mean_scalars([t for times in timed.values() for t in times]))
    names = [layer.name for layer in layers]
    return {
        key: {"workers": comm.world_size, "layers": {name: next(flat) for name in names}} for key in timed
    }


def _profile(order, averaged, link, layers: list[Layer], comm: Communicator, meta) -> dict[str, Any]:
    """The profile's fields from ``_shared``'s results, as if nothing contended."""
    n = len(order)
    by_name = {layer.name: layer for layer in layers}
    return {
        "version": PROFILE_VERSION,
        **(meta or {}),
        "workers": comm.world_size,
        "layers": [
            {
                "name": name,
                "bytes": by_name[name].nbytes,
                "backward_s": averaged[i],
                # what a codec's messages are priced from (``geotrain plan --compress``)
                "shapes": [list(p.shape) for p in by_name[name].params],
            }
            for i, name in enumerate(order)
        ],
        "forward_s": averaged[n],
        "optimizer_s": averaged[n + 1],
        "backward_total_s": averaged[n + 2],
        # A whole step with every worker computing at once; the compute model's parts are scaled
        # to it (``models_from_profile``). 0: not measured, the parts stand as they are.
        "step_s": averaged[n + 4],
        # The mean wait in a barrier after each of those steps, less the link's latency (which
        # the link's line prices): the slowest worker's lead, paid by every blocking collective.
        "sync_wait_s": max(0.0, averaged[n + 5] - link["alpha_s"]),
        "interference_s_per_byte": 0.0,
        "comm_slowdown_in_backward": 1.0,
        "contention_measured": False,
        "spread": {"backward_cv": averaged[n + 3], "link_max_rel_residual": link["max_rel_residual"]},
        "allreduce": {
            **{k: link[k] for k in ("alpha_s", "beta_s_per_byte", "samples")},
            "aggregate": link.get("aggregate", "mean"),  # the trust options measured (cost.guarded_link)
            "checked": link.get("checked", False),
        },
    }


def _shared(
    local: dict[str, Any], layers: list[Layer], comm: Communicator, link: dict[str, Any] | None = None
):
    """Rank 0's backward order, every time averaged over workers in it, and the link's fit
    (``link``: one given, not measured)."""
    names = [layer.name for layer in layers]
    # Every worker adopts rank 0's measured backward order, then times are averaged in that order.
    order = local["order"]
    if comm.world_size > 1:
        index = torch.tensor([names.index(n) for n in order], dtype=torch.int64)
        comm.broadcast(index, src=0)
        order = [names[i] for i in index.tolist()]
    scalars = [local["backward_s"][n] for n in order] + [
        local["forward_s"],
        local["optimizer_s"],
        local["backward_total_s"],
        local["backward_cv"],
        local.get("step_s", 0.0),  # 0: not measured (steps observed in a user's loop)
        local.get("barrier_wait_s", 0.0),
    ]
    averaged = comm.mean_scalars(scalars)
    if link is None:
        link = (
            profile_link(comm, probe_sizes(layers), device=_device(layers))
            if comm.world_size > 1
            else {"alpha_s": 0.0, "beta_s_per_byte": 0.0, "samples": [], "max_rel_residual": 0.0}
        )
    return order, averaged, link


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a forward's output (a tensor, a tuple, a transformers ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    items = (
        output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    )
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    return None


class StepObserver:
    """What ``profile_compute`` measures by calling a loss function, taken from the training
    loop's own steps instead (``geotrain.wrap`` without a plan or ``profile=``): hooks time each
    step's forward, the moment backward reaches the model's output (so the loss and the loop's
    own code between forward and ``backward()`` do not count) and the moment each layer's
    gradient is complete; the caller marks the optimizer update around it. The first step
    observed is a warm-up. On a GPU each time is read once the GPU has finished what was queued."""

    def __init__(self, model: nn.Module, layers: list[Layer]) -> None:
        self.layers = layers
        owner = {id(p): i for i, layer in enumerate(layers) for p in layer.params}
        self._done: dict[int, float] = {}
        self._forward = (0.0, 0.0)
        self._update_start = self._backward_start = 0.0
        self.steps: list[dict[str, Any]] = []
        self._now = now = clock(_device(layers))  # on a GPU: after its queued kernels

        def on_grad(p: torch.Tensor) -> None:
            self._done[owner[id(p)]] = now()

        def started(module, args) -> None:
            if module.training and torch.is_grad_enabled():  # not an evaluation between steps
                self._forward = (now(), 0.0)
                self._done.clear()

        def ended(module, args, output) -> None:
            if module.training and torch.is_grad_enabled():
                self._forward = (self._forward[0], now())
                out = _first_tensor(output)
                if out is not None and out.requires_grad:  # backward reaches the model here: after
                    out.register_hook(self._backward_starts)  # the loss and the loop's own code

        self._hooks = [
            p.register_post_accumulate_grad_hook(on_grad) for layer in layers for p in layer.params
        ]
        self._hooks += [model.register_forward_pre_hook(started), model.register_forward_hook(ended)]

    def _backward_starts(self, grad: torch.Tensor) -> None:
        self._backward_start = self._now()

    def update_starts(self) -> None:
        self._update_start = self._now()

    def update_ended(self) -> None:
        """A step is recorded on every worker alike (they must agree on how many were seen):
        a layer that got no gradient in it took no backward time and comes last."""
        t0, t1 = self._forward
        done = dict(self._done)
        seen = sorted(done, key=done.get)
        order = seen + [i for i in range(len(self.layers)) if i not in done]
        start = self._backward_start if self._backward_start >= t1 > 0 else t1
        backward, previous = dict.fromkeys(range(len(self.layers)), 0.0), start or self._now()
        for i in seen:
            backward[i], previous = max(0.0, done[i] - previous), done[i]
        self.steps.append(
            {
                "order": order,
                "forward_s": t1 - t0 if t1 else 0.0,
                "backward": backward,
                "backward_total_s": max(0.0, previous - start) if t1 else 0.0,
                "optimizer_s": self._now() - self._update_start,
            }
        )
        self._done.clear()
        self._forward, self._backward_start = (0.0, 0.0), 0.0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def profile(self, comm: Communicator, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The profile of the steps observed (the first left out), as ``build_profile`` makes
        it; collective: every worker calls it after the same steps."""
        timed = self.steps[1:] or self.steps
        totals = [s["backward_total_s"] for s in timed]
        local = {
            "order": [self.layers[i].name for i in timed[-1]["order"]],
            "backward_s": {
                self.layers[i].name: statistics.fmean(s["backward"][i] for s in timed)
                for i in range(len(self.layers))
            },
            "forward_s": statistics.fmean(s["forward_s"] for s in timed),
            "backward_total_s": statistics.fmean(totals),
            "backward_cv": statistics.pstdev(totals) / statistics.fmean(totals) if len(totals) > 1 else 0.0,
            "optimizer_s": statistics.fmean(s["optimizer_s"] for s in timed),
        }
        with comm.control_traffic():  # a measurement: not in the training's bytes and seconds
            order, averaged, link = _shared(local, self.layers, comm)
            return {**_profile(order, averaged, link, self.layers, comm, meta), "observed_steps": len(timed)}


def models_from_profile(profile: dict[str, Any]) -> tuple[ComputeModel, LinkModel]:
    if profile.get("version") != PROFILE_VERSION:
        raise ValueError(f"profile version {profile.get('version')} is not {PROFILE_VERSION}; profile again")
    layers = profile["layers"]
    scale = contention_scale(profile)
    compute = ComputeModel(
        names=tuple(layer["name"] for layer in layers),
        backward_s=tuple(scale * float(layer["backward_s"]) for layer in layers),
        nbytes=tuple(int(layer["bytes"]) for layer in layers),
        forward_s=scale * float(profile["forward_s"]),
        optimizer_s=scale * float(profile["optimizer_s"]),
        interference_s_per_byte=float(profile.get("interference_s_per_byte", 0.0)),
        comm_slowdown=float(profile.get("comm_slowdown_in_backward", 1.0)),
        sync_wait_s=float(profile.get("sync_wait_s", 0.0)),  # 0 for an older profile: as it was
    )
    link = LinkModel(float(profile["allreduce"]["alpha_s"]), float(profile["allreduce"]["beta_s_per_byte"]))
    return compute, link


def profile_for_workers(profile: dict[str, Any], workers: int) -> dict[str, Any] | None:
    """What ``profile`` (taken on a group of at least 2) would have measured on a group of
    ``workers`` on the same machines and links, without measuring again: the all-reduce's line
    moved along a ring's terms (2 (N - 1) hops of latency; 2 (N - 1) / N of the bytes through the
    slowest link), the trust options' cost taken out for the move and put back (``cost``); the
    compute as it was (each worker has its own hardware). None where it cannot be moved (taken
    alone). A membership change re-plans from it (DreamDDP's ``rebind``): the profile's link
    probe drains a shaper's burst at three sizes twice, 6 s at 10 Mbit/s on 4 hosts and minutes
    on a slower link, for what a line through the group's size gives. A link that differs
    after all (a joiner's slower uplink) shows as drift, which re-fits the line from the run's
    own steps (``_refit``)."""
    before = int(profile.get("workers", 1))
    if before < 2 or workers < 2:
        return None
    if workers == before:
        return profile
    measured = profile["allreduce"]
    options = measured.get("aggregate", "mean"), bool(measured.get("checked", False))
    line = LinkModel(float(measured["alpha_s"]), float(measured["beta_s_per_byte"]))
    plain = unguarded_link(line, before, *options)
    hops = (workers - 1) / (before - 1)
    share = ((workers - 1) / workers) / ((before - 1) / before)
    moved = guarded_link(LinkModel(plain.alpha_s * hops, plain.beta_s_per_byte * share), workers, *options)
    allreduce = {**measured, "alpha_s": moved.alpha_s, "beta_s_per_byte": moved.beta_s_per_byte}
    return {**profile, "workers": workers, "allreduce": {**allreduce, "samples": [], "moved_from": before}}


def contention_scale(profile: dict[str, Any]) -> float:
    """A whole step over its parts (``step_s`` over forward + backward + optimizer), so that
    the plan prices the whole step. Parts timed inside whole steps (``profile_compute``) leave
    out only zero_grad and the loop between them: about 1. 1 for a profile without ``step_s``
    (one from before whole steps were timed, or one observed in a user's loop)."""
    step_s = float(profile.get("step_s", 0.0))
    parts = float(profile["forward_s"]) + float(profile["backward_total_s"]) + float(profile["optimizer_s"])
    return step_s / parts if step_s > 0 and parts > 0 else 1.0


def codec_times(
    profile: dict[str, Any], compute: ComputeModel, spec: str, workers: int | None = None
) -> tuple[float, ...]:
    """The codec ``spec``'s seconds per layer in ``compute``'s order, as the profile timed them
    (``geotrain profile --compress``, ``plan.codec_time``), scaled as ``compute``'s times were
    (``--compute-scale``); () where the profile did not time it. For ``workers`` other than
    the profile's, a gathering codec's times are scaled by the ratio (it decodes and adds one
    message per worker); the others' work does not grow with the group (a quantiser decodes N
    rows of 1/N of the model)."""
    timed = profile.get("codecs", {}).get(spec)
    if not timed:
        return ()
    grows = spec.partition(":")[0] in SPARSE_CODECS and workers is not None  # one message a worker
    per_worker = workers / max(1, int(timed.get("workers", workers))) if grows else 1.0
    by_name = timed["layers"]
    if set(by_name) != set(compute.names):
        raise ValueError(f"the profile's times of {spec} are for other layers than its own; profile again")
    profiled = sum(float(layer["backward_s"]) for layer in profile["layers"]) * contention_scale(profile)
    scale = per_worker * (compute.backward_total_s / profiled if profiled > 0 else 1.0)
    return tuple(scale * float(by_name[name]) for name in compute.names)
