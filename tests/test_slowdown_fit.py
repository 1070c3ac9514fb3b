"""The link's slowdown under backward, fitted to the time a run's steps were blocked."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

from geotrain.plan.cost import (
    ComputeModel,
    LinkModel,
    exposed_for_layers,
    fit_comm_slowdown,
    predict_schedule,
    window_exposure,
)
from geotrain.plan.layers import layer_groups
from geotrain.sync import build_sync
from test_units import FakeCommunicator, _tiny

L = 12


class Replicas(FakeCommunicator):
    """Identical replicas: every worker measured what this one did."""

    def mean_scalars(self, values):
        return list(values)


def _models(backward_s: float = 0.01) -> tuple[ComputeModel, LinkModel]:
    names = tuple(f"layer{i}" for i in range(L))
    compute = ComputeModel(names, (backward_s,) * L, (250_000,) * L, 0.05, 0.005)
    return compute, LinkModel(0.001, 4e-8)  # 0.011 s a layer: the whole model outlasts backward


def test_each_iterations_exposure_is_counted_in_the_step_it_lands_in():
    compute, link = _models()
    period = [list(range(8)), list(range(8, 12))]
    at_once = [exposed_for_layers(compute, link, it) for it in period]
    assert window_exposure(compute, link, period, lag=0) == pytest.approx(at_once)
    late = exposed_for_layers(compute, link, period[0], late=True)
    # Landing late the first iteration's wait is at the second's forward; the last lands at once.
    assert window_exposure(compute, link, period, lag=1) == pytest.approx([0.0, late + at_once[1]])


@pytest.mark.parametrize("sigma", [1.0, 1.5, 2.35])
def test_the_fit_recovers_the_slowdown_and_the_constant_wait(sigma):
    compute, link = _models()
    period = [list(range(9)), list(range(9, 12))]  # lopsided: its exposure grows with sigma
    measured = [e + 0.02 for e in window_exposure(replace(compute, comm_slowdown=sigma), link, period)]
    fitted, wait = fit_comm_slowdown(compute, link, period, measured)
    assert fitted == pytest.approx(sigma, abs=0.026) and wait == pytest.approx(0.02, abs=2e-3)


def test_a_period_that_says_nothing_about_the_slowdown_keeps_one():
    compute, link = _models(backward_s=1.0)  # a long backward: it hides them at any sigma
    period = [list(range(6)), list(range(6, 12))]
    exposed = window_exposure(compute, link, period)  # the last layer's, after backward at any sigma
    assert fit_comm_slowdown(compute, link, period, [0.03, 0.03]) == (
        1.0,
        pytest.approx(0.03 - sum(exposed) / 2),
    )
    with pytest.raises(ValueError, match="one measured time per iteration of the period \\(2\\), got 3"):
        fit_comm_slowdown(compute, link, period, [0.1, 0.1, 0.1])


def _plan(model, sigma: float = 1.0, alternating: bool = False) -> dict:
    """A lopsided H=2 plan over the tiny model's layers (or alternating ones), priced on
    ``_models``' link."""
    names = [layer.name for layer in layer_groups(model)]
    compute = ComputeModel(
        tuple(names), (0.01,) * len(names), (250_000,) * len(names), 0.05, 0.005, comm_slowdown=sigma
    )
    _, link = _models()
    n = len(names)
    iterations = [list(range(n - 2)), [n - 2, n - 1]]
    if alternating:
        iterations = [list(range(0, n, 2)), list(range(1, n, 2))]
    return (
        {
            "schedule": {
                "H": 2,
                "lag": 0,
                "layers": names,
                "assignment": [next(h for h, it in enumerate(iterations) if i in it) for i in range(n)],
                "iterations": [[names[i] for i in it] for it in iterations],
            },
            "predicted_s": {"dreamddp": predict_schedule(compute, link, iterations, 0)},
            "models": {"compute": asdict(compute), "link": asdict(link), "codec": ""},
        },
        compute,
        link,
        iterations,
    )


def _run(sync, model, opt, comm, steps: int, blocked, check=None) -> None:
    """``steps`` steps of ``sync``, each blocked ``blocked(step)`` seconds as a worker would be
    (0 where None), ``check(step)`` after each."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        xy = torch.randint(0, 256, (2, 17), generator=g)
        _, loss = model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        comm.stats.blocked_s += blocked(step) or 0.0
        sync.before_step()
        opt.step()
        opt.zero_grad()
        sync.after_step()
        if check is not None:
            check(step)


def test_dreamddp_fits_the_slowdown_once_and_searches_its_schedule_again(tmp_path):
    import json

    model = _tiny()
    plan, compute, link, lopsided = _plan(model)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    comm = Replicas(world_size=4)
    sync = build_sync("dreamddp", model, opt, comm, {"plan_path": str(path), "compress": "", "lag": 0})
    truth = window_exposure(replace(compute, comm_slowdown=2.0), link, lopsided)

    def blocked(step):  # as a link twice as slow would leave it
        return truth[step % 2] + 0.01 if sync.schedule.iterations == lopsided else 0.0

    def not_yet(step):  # a warm-up period, then three measured
        assert step + 1 >= 8 or sync.fitted_slowdown is None

    _run(sync, model, opt, comm, 14, blocked, not_yet)
    assert sync.fitted_slowdown == pytest.approx(2.0, abs=0.026)
    assert sync.replans == 1  # once: the later steps are not fitted again
    adopted = sync._plan["models"]["compute"]
    assert adopted["comm_slowdown"] == sync.fitted_slowdown
    assert sync.schedule.iterations != lopsided  # searched again: the lopsided one exposes most
    assert sync.state_dict()["fitted_slowdown"] == sync.fitted_slowdown


def test_no_fit_where_re_plans_are_off(tmp_path):
    import json

    model = _tiny()
    plan, *_ = _plan(model)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    comm = Replicas(world_size=4)
    options = {"plan_path": str(path), "compress": "", "lag": 0, "replan_threshold": 0}
    sync = build_sync("dreamddp", model, opt, comm, options)
    _run(sync, model, opt, comm, 10, lambda step: 0.5)
    assert sync.fitted_slowdown is None and sync.replans == 0


def test_a_fit_keeps_the_schedule_in_use_where_the_search_finds_none_faster(tmp_path, monkeypatch):
    """The search has a time budget: what it returns can be predicted slower than the schedule
    in use, which is then kept (with the fitted models)."""
    import json

    import geotrain.sync.dreamddp_plan as dreamddp_module  # where the schedule is searched
    from geotrain.plan.schedule import Schedule

    model = _tiny()
    plan, compute, link, alternating = _plan(model, alternating=True)
    _, _, _, lopsided = _plan(model)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    n = len(plan["schedule"]["layers"])
    worse = Schedule(2, [0 if i < n - 2 else 1 for i in range(n)], lopsided)
    monkeypatch.setattr(dreamddp_module, "search_schedule", lambda *a, **k: worse)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    comm = Replicas(world_size=4)
    sync = build_sync("dreamddp", model, opt, comm, {"plan_path": str(path), "compress": "", "lag": 0})
    truth = window_exposure(replace(compute, comm_slowdown=2.0), link, alternating)
    _run(sync, model, opt, comm, 8, lambda step: truth[step % 2] + 0.01)
    assert sync.fitted_slowdown is not None and sync.fitted_slowdown > 1.5 and sync.replans == 1
    assert sync.schedule.iterations == alternating  # the search's lopsided one predicted slower
    assert sync._plan["models"]["compute"]["comm_slowdown"] == sync.fitted_slowdown
