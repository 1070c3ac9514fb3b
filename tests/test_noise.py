"""--lr-scale auto: the gradient noise measured across workers at each sync (sync/noise.py).

Closed forms with a fake all-reduce, the normalisation's bound, and a real gloo group of 3 where
every worker must reach the same factor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import build_sync
from geotrain.sync.noise import MIN_MEASURES, NoiseScale
from helpers import run_workers


class SummingComm:
    """An all-reduce over workers whose messages the test gave beforehand (this one's included)."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.others = others
        self.world_size = len(others) + 1
        self.calls = 0

    def all_reduce(self, tensor, op="mean", async_op=False):
        assert op == "sum"  # the norm check judges means: the measure is a sum
        self.calls += 1
        for other in self.others:
            tensor.add_(other)
        return tensor


def _noise(n: int = 64) -> NoiseScale:
    param = torch.nn.Parameter(torch.zeros(n))
    return NoiseScale([param], torch.optim.SGD([param], lr=0.1), samples=n)


def _message(g: torch.Tensor | None, n: int) -> torch.Tensor:
    """What a worker adds to the sum: its sample, its mean square and its weight (fp16)."""
    m = torch.zeros(n + 2, dtype=torch.float16)
    if g is not None:
        m[:n], m[-2], m[-1] = g, g.square().mean(), 1.0
    return m


def test_the_measure_is_the_closed_form_of_the_workers_gradients():
    """B = mean |g_i|^2, A = |mean g_i|^2: |G|^2 = (N A - B) / (N - 1), S = (B - A) N / (N - 1);
    the moving averages start from 0 (the ratio needs no debiasing)."""
    torch.manual_seed(0)
    grads = [(torch.randn(64) + 0.5).half().float() for _ in range(4)]  # what fp16 carries exactly
    noise = _noise()
    noise.pending = grads[0].clone()
    comm = SummingComm([_message(g, 64) for g in grads[1:]])
    noise.exchange(comm)
    big = sum(float(g.square().sum()) for g in grads) / 4
    mean = float((sum(grads) / 4).square().sum())
    g2, s = (4 * mean - big) / 3, (big - mean) * 4 / 3
    assert comm.calls == 1 and noise.pending is None and noise.measures == 1
    # within half precision's rounding of what was sent
    assert noise.g2 == pytest.approx(0.2 * g2, rel=2e-2) and noise.noise == pytest.approx(0.2 * s, rel=2e-2)
    assert noise.signal_fraction() is None  # MIN_MEASURES not yet
    noise.measures = MIN_MEASURES
    rho = g2 / (g2 + s)
    assert noise.signal_fraction() == pytest.approx(rho, rel=2e-2)
    assert noise.factor(4) == pytest.approx(math.sqrt(4 / (4 * rho + 1 - rho)), rel=1e-2)


def test_equal_gradients_give_1_and_pure_noise_gives_sqrt_n():
    same = torch.randn(4096)
    agreeing = _noise(4096)
    for _ in range(MIN_MEASURES):
        agreeing.pending = same.clone()
        agreeing.exchange(SummingComm([_message(same, 4096)] * 3))
    assert agreeing.factor(4) == pytest.approx(1.0, abs=2e-2)  # no noise: DDP's step already
    torch.manual_seed(1)
    noisy = _noise(4096)
    for _ in range(20):  # independent, zero-mean: all noise, no signal
        g = [torch.randn(4096) for _ in range(4)]
        noisy.pending = g[0]
        noisy.exchange(SummingComm([_message(x, 4096) for x in g[1:]]))
    assert noisy.signal_fraction() < 0.02
    assert 1.95 < noisy.factor(4) <= 2.0  # sqrt(N): what --lr-scale sqrt assumes throughout
    assert noisy.factor(1) == 1.0


def test_a_worker_with_nothing_recorded_weighs_nothing_and_two_are_needed():
    """A joiner (no sample of its own) adds zeros and weighs 0; with fewer than two samples in
    the sum nothing is measured; a non-finite sum is ignored."""
    torch.manual_seed(2)
    g = [torch.randn(64) for _ in range(3)]
    noise = _noise()
    noise.pending = None  # the joiner
    noise.exchange(SummingComm([_message(x, 64) for x in g]))
    ref = _noise()
    ref.pending = g[0].clone()
    ref.exchange(SummingComm([_message(x, 64) for x in g[1:]]))
    assert noise.measures == ref.measures == 1
    assert noise.g2 == pytest.approx(ref.g2, rel=1e-5) and noise.noise == pytest.approx(ref.noise, rel=1e-5)
    lonely = _noise()
    lonely.pending = g[0].clone()
    lonely.exchange(SummingComm([_message(None, 64)]))
    assert lonely.measures == 0
    spoiled = _noise()
    spoiled.pending = g[0].clone()
    spoiled.exchange(SummingComm([_message(torch.full((64,), float("nan")), 64)]))
    assert spoiled.measures == 0 and spoiled.g2 == 0.0


def test_the_sample_is_normalised_by_adams_v_and_bounded():
    """|g| / sqrt(beta2 v + (1 - beta2) g^2) <= 1 / sqrt(1 - beta2): a coordinate whose v is 0 (an
    embedding row seen for the first time) cannot dominate the sums. SGD keeps no v: nothing."""
    param = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.AdamW([param], lr=0.1, betas=(0.9, 0.95))
    noise = NoiseScale([param], opt, samples=8)
    param.grad = torch.full((8,), 1e-3)
    noise.record()
    assert noise.pending is None  # no step yet: Adam has no v
    opt.step()
    opt.state[param]["exp_avg_sq"][0] = 0.0
    param.grad = torch.tensor([1e6, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])
    noise.record()
    assert noise.pending is not None and float(noise.pending.abs().max()) <= 1 / math.sqrt(0.05) + 1e-4
    sgd_param = torch.nn.Parameter(torch.zeros(8))
    plain = NoiseScale([sgd_param], torch.optim.SGD([sgd_param], lr=0.1), samples=8)
    sgd_param.grad = torch.ones(8)
    plain.record()
    assert plain.pending is None and plain.factor(4) == 1.0


def test_options_are_validated():
    param = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([param], lr=0.1)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        NoiseScale([param], opt, samples=0)
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\)"):
        NoiseScale([param], opt, decay=1.0)


def _plan(path: str, model: GPT, H: int) -> str:
    """A fixed DreamDDP plan: layer i averaged at iteration i mod H."""
    from geotrain.plan.layers import layer_groups

    names = [layer.name for layer in reversed(layer_groups(model))]
    assignment = [i % H for i in range(len(names))]
    iterations = [[n for n, a in zip(names, assignment, strict=True) if a == h] for h in range(H)]
    Path(path).write_text(
        json.dumps(
            {"schedule": {"H": H, "layers": names, "assignment": assignment, "iterations": iterations}}
        )
    )
    return path


def _auto_worker(rank, world_size, algo, tmp):
    """``algo`` (H=2) under lr_scale auto on 3 workers with their own batches: the factors each
    worker applied at each step, and its noise state."""
    from geotrain.api import Sync

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = Communicator()
    options = {"H": 2}
    if algo == "dreamddp":
        options.update(plan_path=_plan(f"{tmp}/plan{rank}.json", model, 2), replan_threshold=0.0)
    stepper = Sync(build_sync(algo, model, opt, comm, options), opt, "auto")
    factors = []
    for step in range(16):
        g = torch.Generator().manual_seed(1000 * rank + step)
        xy = torch.randint(0, 256, (2, 17), generator=g)
        stepper.model(xy[:, :-1], xy[:, 1:])[1].backward()
        factors.append(stepper.lr_factor())
        stepper.step()
        stepper.zero_grad()
    noise = stepper.algorithm.noise
    out = {"factors": factors, "state": noise.state_dict()}
    stepper.finish()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["localsgd", "diloco", "dreamddp"])
def test_every_worker_reaches_the_same_factor_on_gloo(algo, tmp_path):
    """The moving averages come from one all-reduce: bitwise the same on every worker, so every
    replica steps at the same rate. Random tokens are noise-dominated: the factor rises from 1
    (until MIN_MEASURES syncs are measured) towards sqrt(3)."""
    results = run_workers(_auto_worker, 3, algo, str(tmp_path), timeout=100)
    assert results[0]["factors"] == results[1]["factors"] == results[2]["factors"]
    assert results[0]["state"] == results[1]["state"] == results[2]["state"]
    factors = results[0]["factors"]
    # Syncs (DreamDDP: period ends) at steps 2, 4, ...; the first period has no Adam v at its
    # first step: measured at 4 and 6, so the step after the second (step 7, index 6) is scaled.
    assert factors[:6] == [1.0] * 6
    assert all(1.0 < f <= math.sqrt(3) for f in factors[6:])
    assert results[0]["state"]["measures"] == 7


def test_a_regroup_leaves_every_member_the_same_measure():
    """An exchange a failure cut short may have landed on some members only: after the regroup
    each takes, whole, the state of the member that measured most."""

    class GatherComm:
        def __init__(self, others: list[dict]) -> None:
            self.others = others

        def all_gather_object(self, obj):
            return [obj, *self.others]

    behind, ahead = _noise(), _noise()
    behind.g2, behind.noise, behind.measures = 1.0, 9.0, 3
    ahead.g2, ahead.noise, ahead.measures = 1.5, 8.0, 4
    behind.agree(GatherComm([ahead.state_dict()]))
    ahead.agree(GatherComm([{"g2": 1.0, "noise": 9.0, "measures": 3}]))
    assert behind.state_dict() == ahead.state_dict() == {"g2": 1.5, "noise": 8.0, "measures": 4}


@pytest.mark.parametrize(
    "algo, options, measured",
    [("localsgd", {}, True), ("diloco", {}, True), ("dreamddp", {}, True)]
    + [("co2", {"eager": False}, True), ("sparseloco", {"overlap": False}, True)]
    # eager co2 and overlapping sparseloco start a period from each worker's own point
    + [("co2", {}, False), ("sparseloco", {}, False)]
    + [("ssgd", {}, False), ("ddp", {}, False), ("nosync", {}, False), ("streaming", {}, False)]
    + [("demo", {}, False)],
)
def test_auto_measures_where_a_period_starts_from_common_parameters(algo, options, measured):
    """The methods that measure (``measures_noise``) get a NoiseScale; the others step at 1."""
    from geotrain.api import Sync

    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comm = Communicator()  # a group of one: nothing is exchanged, the factor is 1
    stepper = Sync(build_sync(algo, model, opt, comm, options), opt, "auto")
    assert stepper.algorithm.measures_noise is measured
    assert (stepper.algorithm.noise is not None) is measured
    assert stepper.lr_factor() == 1.0
    stepper.algorithm.close()


def test_the_sample_takes_distinct_coordinates_the_same_for_a_seed():
    from geotrain.sync.noise import _sample

    for total, k in ((10, 10), (5000, 1000), (10**9, 2048)):
        a, b = _sample(total, k, 0), _sample(total, k, 0)
        assert torch.equal(a, b) and a.numel() == min(k, total) == a.unique().numel()
        assert int(a.min()) >= 0 and int(a.max()) < total and torch.equal(a, a.sort().values)
