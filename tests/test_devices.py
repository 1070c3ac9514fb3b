"""Where tensors live and which backend moves them: pure logic, runnable without a GPU (the
CUDA runs themselves are in test_cuda.py, skipped here). The ``meta`` device stands in for a
GPU where only placement is checked."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta

import pytest
import torch

from geotrain.comm.communicator import MembershipChanged, wait_work
from geotrain.compress.codec import make_codec
from geotrain.launch.dist import NCCL, choose_backend, uses_nccl
from geotrain.launch.local import RunFailed, _gpu_of, backend_for_hosts
from geotrain.launch.procs import host_env
from geotrain.plan.profile import clock
from geotrain.sync.base import InFlight
from geotrain.train import TrainConfig
from helpers import geotrain


@pytest.mark.parametrize(
    "requested, gpus, workers, backend",
    [
        ("auto", 0, 4, "gloo"),  # no GPU
        ("auto", 1, 1, NCCL),  # a GPU of its own: NCCL, gloo beside it for CPU tensors
        ("auto", 8, 8, NCCL),
        ("auto", 1, 2, "gloo"),  # two workers share a GPU: NCCL would refuse them
        ("gloo", 4, 1, "gloo"),
        ("nccl", 2, 2, NCCL),
    ],
)
def test_the_backend_is_nccl_only_where_every_worker_has_a_gpu_of_its_own(requested, gpus, workers, backend):
    assert choose_backend(requested, gpus, workers) == backend
    assert uses_nccl(backend) == (backend == NCCL)


@pytest.mark.parametrize(
    "requested, gpus, workers, needle",
    [
        ("nccl", 0, 1, "needs a CUDA GPU, and none is visible"),
        ("nccl", 1, 2, "2 workers on this machine share 1 GPU(s)"),
        ("mpi", 1, 1, "backend takes auto, nccl, gloo"),
    ],
)
def test_a_backend_that_cannot_work_is_refused_with_what_to_change(requested, gpus, workers, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        choose_backend(requested, gpus, workers)


def test_the_launcher_gives_each_host_a_gpu_and_gloo_where_they_must_share():
    cfg = TrainConfig()
    assert backend_for_hosts(cfg, 4, 0) is cfg  # CPU: the trainers choose gloo themselves
    assert backend_for_hosts(cfg, 2, 2) is cfg  # a GPU each: NCCL, chosen by each trainer
    assert backend_for_hosts(cfg, 3, 2).backend == "gloo"
    assert backend_for_hosts(TrainConfig(backend="gloo"), 3, 2).backend == "gloo"
    assert backend_for_hosts(TrainConfig(backend="nccl"), 2, 2).backend == "nccl"
    with pytest.raises(
        RunFailed,
        match=re.escape("--backend nccl needs a GPU per host: 3 hosts on this machine share 2 GPU(s)"),
    ):
        backend_for_hosts(TrainConfig(backend="nccl"), 3, 2)
    with pytest.raises(RunFailed, match="--backend nccl needs a CUDA GPU, and none is visible: use gloo"):
        backend_for_hosts(TrainConfig(backend="nccl"), 2, 0)
    # regrouping after a loss has not run on NCCL: an elastic run's auto is gloo
    assert TrainConfig(elastic=True).process_backend() == "gloo"
    assert TrainConfig(elastic=True, backend="nccl").process_backend() == "nccl"
    assert TrainConfig().process_backend() == "auto"

    class Launch:
        gpus = ("2", "5")  # as CUDA_VISIBLE_DEVICES names them

    assert [_gpu_of(Launch, m) for m in range(3)] == ["2", "5", "2"]
    assert host_env(None, 1, gpu="5")["CUDA_VISIBLE_DEVICES"] == "5"
    Launch.gpus = ()
    assert _gpu_of(Launch, 0) == ""
    assert host_env(None, 1, gpu="").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


class _SlowWork:
    """A collective that completes after ``polls`` checks; records how it was waited for."""

    def __init__(self, polls: int) -> None:
        self.polls, self.timed_waits, self.waits = polls, 0, 0

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
            raise RuntimeError("timed out")  # gloo's: the work stays as it was
        self.waits += 1
        return True


def test_a_wait_on_nccl_polls_and_never_times_out_a_wait():
    """NCCL aborts its communicator when a timed wait expires: on a group with NCCL the work is
    polled; on gloo a timed wait (which returns at completion) is the poll."""
    work = _SlowWork(3)
    wait_work(work, lambda: False, timed_waits=False)
    assert work.timed_waits == 0 and work.waits == 1
    work = _SlowWork(3)
    wait_work(work, lambda: False, timed_waits=True)
    assert work.timed_waits >= 1 and work.waits == 1
    with pytest.raises(MembershipChanged):
        wait_work(_SlowWork(10**9), lambda: True, timed_waits=False)


def test_restored_state_goes_back_to_the_models_device():
    """A snapshot holds state on the CPU; restored, a codec's per-stream state goes back to the
    model's device, where it encodes, and a message in flight is sent again from there."""
    meta = torch.device("meta")
    for spec in ("powersgd:rank=2", "fp16", "int8", "int4", "sign", "chunktopk"):
        codec = make_codec(spec)
        state = {"spec": codec.spec(), "streams": [("layer", {"residual": torch.ones(4)})]}
        codec.load_state_dict(state, meta)
        assert codec.state("layer")["residual"].device == meta, spec
        codec.load_state_dict(state)  # no device: as saved
        assert codec.state("layer")["residual"].device.type == "cpu"
    flying = InFlight(comm=None)
    flying.restore(torch.ones(3), meta)
    assert flying.saved().device == meta
    flying.restore(None, meta)
    assert flying.saved() is None


def test_a_profile_clock_is_the_wall_clock_on_the_cpu():
    now = clock(torch.device("cpu"))
    assert now is time.perf_counter


def test_a_run_under_bf16_autocast_keeps_fp32_parameters_and_says_so(tmp_path):
    """The same run with and without ``--autocast bf16``: both fp32 parameters, other losses
    (the forwards ran in bfloat16)."""
    summaries = {}
    for cast in ("bf16", "off"):
        run_dir = tmp_path / cast
        proc = geotrain(["run", "--workers", "2", "--no-netem", "--model", "tiny", "--steps", "4",
                         "--algo", "diloco", "--H", "2", "--autocast", cast, "--no-progress",
                         "--run-dir", str(run_dir)])  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        summaries[cast] = json.loads((run_dir / "summary.json").read_text())
        model = torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]
        assert all(t.dtype == torch.float32 for t in model.values() if t.is_floating_point())
    bf16, off = summaries["bf16"], summaries["off"]
    assert (bf16["autocast"], bf16["backend"], bf16["device"]) == ("bf16", "gloo", "cpu")
    assert bf16["first_train_loss"] != off["first_train_loss"]
    assert abs(bf16["final_val_loss"] - off["final_val_loss"]) < 0.05 * off["final_val_loss"]


@pytest.mark.parametrize("spec", ["int8", "int4", "sign"])
def test_the_quantisers_gpu_path_decodes_non_finite_blocks_as_the_cpus(spec):
    """The quantisers ask nothing of a GPU mid-backward and decode nothing twice: the decoded
    values each one returns with its bytes are, bit for bit, what those bytes decode to, finite
    blocks and not (the error feedback keeps the difference), on every device alike."""
    codec = make_codec(spec)
    rows = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))
    rows[0, 5] = float("inf")
    rows[1, 3000] = float("nan")
    block = codec.layout(4096, 1)[0]
    asked = codec.encode_with_values(rows.clone(), block)
    unasked = (codec.encode(rows.clone(), block), codec.decode(asked[0], 4096, block))
    assert torch.equal(asked[0], unasked[0])
    assert torch.equal(asked[1].view(torch.int32), unasked[1].view(torch.int32))  # NaNs too
