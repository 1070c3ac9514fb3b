"""DreamDDP's execution on real gloo groups: the paper's semantics, exactly."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from geotrain.comm.communicator import Communicator
from geotrain.ft.state import param_digest, tensors_digest
from geotrain.models.gpt import GPT, gpt_config
from geotrain.plan.layers import layer_groups
from geotrain.sync import build_sync
from geotrain.sync.base import MIN_SNAPSHOT_EVERY
from helpers import run_workers

BATCH, BLOCK, LR = 2, 16, 0.1


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    xy = torch.randint(0, 256, (BATCH, BLOCK + 1), generator=g)
    return xy[:, :-1], xy[:, 1:]


def _model():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", 256, BLOCK))


def _plan(model, H):
    """Round-robin over the layers in backward order: every layer once per period."""
    names = [layer.name for layer in layer_groups(model)]
    assignment = [i % H for i in range(len(names))]
    return {
        "schedule": {
            "H": H,
            "layers": names,
            "assignment": assignment,
            "iterations": [[n for n, a in zip(names, assignment, strict=True) if a == h] for h in range(H)],
        }
    }


def _dreamddp_steps(rank, world_size, H, steps, lag=0, compress=""):
    """Per step: params after the all-reduces (before the step), local grads, params after the step,
    and a reference gradient computed by a plain backward on a copy of the pre-step model."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": H, "replan_threshold": 0.0, "lag": lag, "compress": compress}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.set_plan(_plan(model, H))
    out = []
    for step in range(steps):
        x, y = _batch(rank, step)
        reference = copy.deepcopy(model)
        reference(x, y)[1].backward()
        active = sorted(sync._active)
        _, loss = sync.model(x, y)
        loss.backward()
        launched_with_complete_grads = all(
            all(p.grad is not None for p in sync.layers[i].params) for i in sync._inflight
        )
        sync.before_step()
        in_flight = sorted(sync.layers[i].name for i in sync._late)
        averaged = {sync.layers[i].name: [p.detach().clone() for p in sync.layers[i].params] for i in active}
        grads = [p.grad.clone() for p in model.parameters()]
        ref_grads = [p.grad.clone() for p in reference.parameters()]
        opt.step()
        opt.zero_grad()
        sync.after_step()
        out.append(
            {
                "averaged": averaged,
                "grads": grads,
                "ref_grads": ref_grads,
                "params": [p.detach().clone() for p in model.parameters()],
                "complete": launched_with_complete_grads,
                "n_active": len(active),
                "loss": loss.item(),
                "in_flight": in_flight,
            }
        )
    sync.close()
    return out


def _localsgd_one_step(rank, world_size):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = build_sync("localsgd", model, opt, Communicator(), {"H": 1})
    x, y = _batch(rank, 0)
    sync.model(x, y)[1].backward()
    sync.before_step()
    opt.step()
    sync.after_step()
    return [p.detach().clone() for p in model.parameters()]


def test_h1_mean_over_replicas_equals_localsgd_h1():
    dream = run_workers(_dreamddp_steps, 2, 1, 1)
    local = run_workers(_localsgd_one_step, 2)
    for i, p in enumerate(local[0]):
        mean = (dream[0][0]["params"][i] + dream[1][0]["params"][i]) / 2
        torch.testing.assert_close(mean, p, atol=1e-7, rtol=1e-6)
    # ... while each replica keeps its own step: they differ again
    assert not torch.equal(dream[0][0]["params"][0], dream[1][0]["params"][0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_averaged_then_own_step_exactly(world_size):
    H, steps = 3, 6
    results = run_workers(_dreamddp_steps, world_size, H, steps)
    names = [n for n, _ in _model().named_parameters()]
    for step in range(steps):
        mine = results[0][step]
        assert mine["n_active"] >= 1
        # right after its all-reduce, before the step, a scheduled layer is identical everywhere
        for other in results[1:]:
            for layer, values in mine["averaged"].items():
                for a, b in zip(values, other[step]["averaged"][layer], strict=True):
                    assert torch.equal(a, b), f"step {step}: {layer} differs across replicas"
        for r in results:
            rec = r[step]
            assert rec["complete"]  # every launch came after the layer's gradient was accumulated
            # backward saw the local parameters, not averaged ones: grads equal a plain backward
            for g, ref in zip(rec["grads"], rec["ref_grads"], strict=True):
                assert torch.equal(g, ref)
            # a scheduled layer became avg(x) - lr * g_local
            model = _model()
            owner = {id(p): layer.name for layer in layer_groups(model) for p in layer.params}
            params = dict(zip(names, rec["params"], strict=True))
            grads = dict(zip(names, rec["grads"], strict=True))
            for name, p in model.named_parameters():
                layer = owner[id(p)]
                if layer in rec["averaged"]:
                    idx = [id(q) for q in next(lg for lg in layer_groups(model) if lg.name == layer).params]
                    avg = rec["averaged"][layer][idx.index(id(p))]
                    # computed as SGD does (one fused add), so the comparison can be exact
                    assert torch.equal(params[name], avg.add(grads[name], alpha=-LR))


@pytest.mark.parametrize("compress", ["", "int8", "powersgd:rank=2"])
def test_lag_1_lands_each_average_at_the_layers_next_forward_where_lag_0_takes_its_gradient(compress):
    """lag 1 keeps an iteration's averages in flight through the update, and lands each at its
    layer's next forward as x + (mean - sent): the point lag 0 reaches (mean - lr g). So every
    forward sees lag 0's parameters (to rounding) and a period ends with them; only the period's
    last iteration lands at once. With a codec the same, in changes from the reference (the
    codec's second phase launched before the update, waited for at the forward)."""
    H, steps = 3, 7
    late = run_workers(_dreamddp_steps, 2, H, steps, 1, compress)
    now = run_workers(_dreamddp_steps, 2, H, steps, 0, compress)
    layers = {layer.name for layer in layer_groups(_model())}
    for step in range(steps):
        for r in range(2):
            a, b = late[r][step], now[r][step]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), f"step {step}"
            assert not b["in_flight"]
            if step % H == H - 1:  # the period ends with nothing in flight, on lag 0's parameters
                assert not a["in_flight"]
                # (a quantiser may round a change that differs in its last bit to the next level)
                atol = 1e-4 if compress else 1e-6
                for p, q in zip(a["params"], b["params"], strict=True):
                    torch.testing.assert_close(p, q, atol=atol, rtol=1e-5)
            else:  # the iteration's scheduled layers are still on the link through the update
                assert a["in_flight"] and set(a["in_flight"]) <= layers
                assert set(a["in_flight"]) == set(b["averaged"]), f"step {step}"


def _advanced_after_backward(rank, world_size, compress, lag):
    """Per step: whether each average in flight when backward returns has its second phase out."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": 2, "replan_threshold": 0.0, "lag": lag, "compress": compress}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.set_plan(_plan(model, 2))
    out = []
    for step in range(4):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        out.append([message.advanced for message, _ in sync._inflight.values()])
        sync.before_step()
        opt.step()
        opt.zero_grad()
        sync.after_step()
    sync.close()
    return out


@pytest.mark.parametrize("compress", ["int4", "powersgd:rank=2"])
def test_a_codecs_second_phases_go_out_under_backward_where_its_averages_land_at_once(compress):
    """Landing at once (lag 0, or lag 1's last iteration of a period), each layer's second phase
    is launched when the first of the layer ``ADVANCE_DEPTH`` launches later goes out: after
    backward only the last ``ADVANCE_DEPTH`` launched are left to advance. Landing late, none
    is (they go out under the update and the forward)."""
    from geotrain.plan.cost import ADVANCE_DEPTH

    for lag in (0, 1):
        steps = run_workers(_advanced_after_backward, 2, compress, lag)
        assert steps[0] == steps[1]
        for step, advanced in enumerate(steps[0]):
            assert len(advanced) > ADVANCE_DEPTH, f"step {step}: too few layers to tell"
            if lag == 0 or step % 2 == 1:
                expected = [True] * (len(advanced) - ADVANCE_DEPTH) + [False] * ADVANCE_DEPTH
                assert advanced == expected, f"lag {lag}, step {step}"
            else:
                assert not any(advanced), f"lag {lag}, step {step}"


def _late_state(rank, world_size, compress=""):
    """Two steps at lag 1, then a snapshot's state_dict inside the period: it lands what flies."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": 4, "replan_threshold": 0.0, "lag": 1, "compress": compress}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.set_plan(_plan(model, 4))
    _train_steps(sync, opt, rank, 2)
    flying = len(sync._late)
    state = sync.state_dict()
    landed = [p.detach().clone() for p in model.parameters()]
    left = len(sync._late)
    # one more step in flight: a restore drops it (a mean taken before must not land after), and
    # close leaves no work pending on the group
    x, y = _batch(rank, 2)
    sync.model(x, y)[1].backward()
    sync.before_step()
    in_flight_again = len(sync._late)
    sync.load_state_dict(state)
    restored_clean = not sync._late and not sync._sent
    opt.zero_grad()
    x, y = _batch(rank, 3)
    sync.model(x, y)[1].backward()
    sync.before_step()
    sync.close()
    return flying, left, landed, in_flight_again, restored_clean, len(sync._late)


@pytest.mark.parametrize("compress", ["", "int8"])
def test_lag_1_in_flight_lands_at_a_snapshot_and_is_dropped_by_a_restore_or_close(compress):
    results = run_workers(_late_state, 2, compress)
    now = run_workers(_dreamddp_steps, 2, 4, 2, 0, compress)
    for r, (flying, left, landed, again, restored_clean, after_close) in enumerate(results):
        assert flying > 0 and left == 0
        assert again > 0 and restored_clean and after_close == 0
        for p, q in zip(landed, now[r][1]["params"], strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def _late_at_a_regroup(rank, world_size):
    """ACP-SGD at lag 1: two steps (settled), then a regroup's first act (``roll_back``), then
    a hand-over's capture (``state_dict``)."""
    from geotrain.compress.codec import shared_entries

    def shared() -> list[torch.Tensor]:
        state = shared_entries(sync.codec.state_dict())
        return [t.clone() for _, v in state["streams"] for _, t in sorted(v.items())]

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": 4, "replan_threshold": 0.0, "lag": 1, "compress": "acpsgd:rank=2"}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.set_plan(_plan(model, 4))
    _train_steps(sync, opt, rank, 2, settle=True)
    flying, before = len(sync._late), shared()
    params = [p.detach().clone() for p in model.parameters()]
    sync.roll_back()
    sync.state_dict()
    after = shared()
    kept = all(torch.equal(p, q) for p, q in zip(params, model.parameters(), strict=True))
    same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    sync.close()
    return flying, same, kept


def test_a_regroup_forgets_the_means_in_flight_before_a_capture_can_land_them_on_its_sender_alone():
    """At a regroup a survivor's late means (lag 1) are of the group that failed: ``rebind``
    forgets them on every member, but a hand-over's capture before it landed them on the sender
    (``state_dict`` lands what flies), replacing its ACP-SGD factors after the rollback had put
    every survivor's back: the adopters took factors the other survivors lacked. They are
    forgotten first now: nothing lands, the factors stay as the last complete step left them."""
    for flying, same, kept in run_workers(_late_at_a_regroup, 2):
        assert flying > 0  # (something in flight to land: the test can fail)
        assert same and kept


def _late_at_an_admission(rank, world_size, compress):
    """Two steps at lag 1 (settled), then an admission at that boundary: ``land_in_flight`` on
    every member (the group is whole), then the regroup's first act (``roll_back``)."""
    from geotrain.compress.codec import shared_entries

    def shared() -> list[torch.Tensor]:
        state = shared_entries(sync.codec.state_dict()) if sync.codec is not None else None
        if state is None:  # (a codec with no shared entries: int8)
            return []
        return [t.clone() for _, v in state["streams"] for _, t in sorted(v.items())]

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": 4, "replan_threshold": 0.0, "lag": 1, "compress": compress}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.set_plan(_plan(model, 4))
    _train_steps(sync, opt, rank, 2, settle=True)
    flying, settled = len(sync._late), shared()
    sync.land_in_flight()
    landed = [p.detach().clone() for p in model.parameters()]
    now = shared()
    moved = [len(now) != len(settled)] + [not torch.equal(a, b) for a, b in zip(settled, now, strict=False)]
    sync.roll_back()
    kept = all(torch.equal(p, q) for p, q in zip(landed, model.parameters(), strict=True))
    after = shared()
    # the factors the landing replaced are back: a member that saw a loss first never landed
    same = len(settled) == len(after) and all(torch.equal(a, b) for a, b in zip(settled, after, strict=True))
    sync.close()
    return flying, len(sync._late), landed, kept and same, after, any(moved)


@pytest.mark.parametrize("compress", ["", "int8", "acpsgd:rank=2"])
def test_an_admission_lands_the_means_in_flight_on_every_member_and_the_regroup_keeps_them(compress):
    """An admission is agreed at a step boundary where the group is whole: lag 1's means of the
    last iteration land there on every member (the values a snapshot's capture lands, the same
    as lag 0's), where the regroup used to forget them on all of them. The regroup's rollback
    keeps them, and puts back the factor a landing replaced (ACP-SGD's), as on a member that saw a
    loss of a member first and never landed: the shared entries stay one."""
    results = run_workers(_late_at_an_admission, 2, compress)
    now = run_workers(_dreamddp_steps, 2, 4, 2, 0, compress) if "acpsgd" not in compress else None
    assert len({repr([t.tolist() for t in r[4]]) for r in results}) == 1
    for r, (flying, left, landed, kept, shared, moved) in enumerate(results):
        assert flying > 0 and left == 0  # (something in flight to land: the test can fail)
        assert kept
        assert bool(shared) == moved == ("acpsgd" in compress)  # (a factor the landing replaced)
        if now is not None:
            for p, q in zip(landed, now[r][1]["params"], strict=True):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def _drift_at_a_regroup(rank, world_size):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = build_sync("dreamddp", model, opt, Communicator(), {"H": 2, "replan_threshold": 0.1})
    sync.set_plan(_plan(model, 2))
    _train_steps(sync, opt, rank, 2)
    # a failure in a period end's agreement: one survivor counted a drifted period, one not
    sync._drifted = rank
    sync.rebind()
    drifted = sync._drifted
    sync.close()
    return drifted


def test_a_regroup_leaves_every_member_with_no_drift_counted():
    """Survivors of a failure inside a period end's agreement (or the re-plan it began) held
    drift counts one apart: at the next drifted period one re-planned (a collective of its own)
    where the other went on to its layers' all-reduces. A regroup re-plans every member, and
    the count starts again everywhere."""
    assert run_workers(_drift_at_a_regroup, 2) == [0, 0]


def test_every_layer_averaged_once_per_period():
    H = 4
    results = run_workers(_dreamddp_steps, 2, H, H)
    seen = [name for rec in results[0] for name in rec["averaged"]]
    assert sorted(seen) == sorted(layer.name for layer in layer_groups(_model()))


def _profiled(rank, world_size):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = build_sync("dreamddp", model, opt, Communicator(), {"H": 3})

    def loss_fn():
        x, y = _batch(rank, 99)
        return model(x, y)[1]

    sync.prepare(loss_fn)
    schedule = sync.schedule
    before = [p.detach().clone() for p in model.parameters()]
    return {
        "iterations": schedule.iterations,
        "layers": [layer.name for layer in sync.layers],
        "grads_clear": all(p.grad is None for p in model.parameters()),
        "before": before,
        "predicted": sync.predicted_step_s,
    }


def test_start_up_profile_gives_every_worker_the_same_schedule():
    a, b = run_workers(_profiled, 2)
    assert a["iterations"] == b["iterations"] and a["layers"] == b["layers"]
    assert len(a["iterations"]) == 3 and a["grads_clear"] and a["predicted"] > 0
    # profiling took no optimizer step: the model is still the initial one
    for p, q in zip(a["before"], _model().parameters(), strict=True):
        assert torch.equal(p, q.detach())


def _auto_period(rank, world_size):
    import geotrain.sync.dreamddp_plan as dreamddp_module  # where the choices are made

    if rank == 1:  # a worker whose own search would choose otherwise: rank 0's choice is taken
        # (7 is no candidate, so rank 0's own search can never choose it: a loaded machine's profile did 5)
        dreamddp_module.choose_period = lambda *a, **k: (7, [{"H": 7, "time_to_loss_factor": 0.5}])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": "auto", "replan_threshold": 0.0, "compress": ""}  # fp32 (auto: the next test)
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.prepare(lambda: model(*_batch(rank, 99))[1])
    chosen = {"H": sync.schedule.H, "config_H": sync.config.H, "rows": sync.period_choice}
    chosen["snapshot_every"] = sync.default_snapshot_every()
    chosen["options"] = sync.resolved_options()
    sync._plan_with(*sync._models)  # a re-plan (a drift refit, a regroup) keeps the period
    chosen["replanned_H"] = sync.schedule.H
    chosen["saved"] = sync.state_dict()["plan"]["period_choice"]
    return chosen


def test_H_auto_chooses_the_period_at_start_up_and_every_worker_takes_rank_0s():
    a, b = run_workers(_auto_period, 2)
    assert a["H"] == b["H"] == a["config_H"] == b["config_H"] == a["replanned_H"] == b["replanned_H"]
    assert a["rows"] == b["rows"] == a["saved"]  # rank 0's table, kept with the plan in a snapshot
    assert [r["H"] for r in a["rows"]][:2] == [1, 2] and a["H"] != 7
    assert a["H"] == min(a["rows"], key=lambda r: r["time_to_loss_factor"])["H"]
    assert a["options"] == {"H": f"auto ({a['H']})", "lag": 1}  # the summary says what ran
    assert (
        a["snapshot_every"] % a["H"] == 0
        and MIN_SNAPSHOT_EVERY <= a["snapshot_every"] < MIN_SNAPSHOT_EVERY + a["H"]
    )


INT4 = "int4:warmup=0,block=256"


def _tensors(state) -> list[torch.Tensor]:
    """Every tensor in a nested state, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in _tensors(item)]
    return []


def _auto_codec(rank, world_size):
    import geotrain.sync.dreamddp_plan as dreamddp_module  # where the choices are made

    real = dreamddp_module.choose_codec
    seen = {}

    def forced(candidates, H, choose, **kw):  # rank 0 takes int4, whatever its own search says
        seen["candidates"] = {spec: lag for spec, (_, _, lag) in candidates.items()}
        seen["encoding_priced"] = all(c.codec_s for spec, (c, _, _) in candidates.items() if spec)
        table = real(candidates, H, choose, **kw)[2]
        return (INT4, H or 2, table) if rank == 0 else ("", 1, [])

    dreamddp_module.choose_codec = forced
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"H": "auto", "compress": "auto", "replan_threshold": 0.0}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    assert sync.codec is None  # nothing chosen before the plan
    sync.prepare(lambda: model(*_batch(rank, 99))[1])
    first_refs = [t.clone() for ts in sync._ref.values() for t in ts]
    out = {
        "codec": sync.codec.spec(),
        "H": sync.schedule.H,
        "lag": sync.lag,
        "options": sync.resolved_options(),
        "choice": sync.codec_choice,
        "period_rows": sync.period_choice,
        "seen": seen,
    }
    _train_steps(sync, opt, rank, 5)
    state = sync.state_dict()
    out["refs"] = [t.clone() for ts in sync._ref.values() for t in ts]
    out["refs_moved"] = not all(torch.equal(a, b) for a, b in zip(first_refs, out["refs"], strict=True))
    sync._plan_with(*sync._models)  # a re-plan keeps the codec
    out["replanned_codec"] = sync.codec.spec()
    sync.close()
    # A fresh run resumed from the snapshot: the plan's codec, its residuals and references back.
    resumed = build_sync("dreamddp", _model(), torch.optim.AdamW(model.parameters()), Communicator(), options)
    resumed.load_state_dict(state)
    out["resumed_codec"] = resumed.codec.spec()
    refs = [(a, b) for name, ts in state["ref"].items() for a, b in zip(resumed._ref[name], ts, strict=True)]
    out["refs_back"] = all(torch.equal(a, b) for a, b in refs)
    residuals = [_tensors(c.state_dict()["streams"]) for c in (resumed.codec, sync.codec)]
    out["residual_back"] = len(residuals[0]) > 0 and all(
        torch.equal(a, b) for a, b in zip(*residuals, strict=True)
    )
    out["resumed_H"] = resumed.schedule.H
    resumed.close()
    return out


def test_compress_auto_chooses_the_codec_at_start_up_rank_0s_everywhere_and_keeps_it():
    """``--compress auto``: every candidate priced with its encoding timed (the profile times
    each quantiser) at the lag a run with it lands at; rank 0's choice taken by every worker
    (rank 1's stand-in would choose none); kept through a re-plan and a resume from a snapshot."""
    a, b = run_workers(_auto_codec, 2)
    assert a["codec"] == b["codec"] == a["replanned_codec"] == a["resumed_codec"] == INT4
    assert a["H"] == b["H"] == a["resumed_H"] and a["lag"] == b["lag"] == 0  # a codec lands at once
    int8, ctk = "int8:warmup=0,block=256", "chunktopk:warmup=0,chunk=4096,k=64,bits=2,decay=1.0"
    assert a["seen"]["candidates"] == {"": 1, int8: 0, INT4: 0, ctk: 0} and a["seen"]["encoding_priced"]
    assert a["choice"] == b["choice"] and {r["codec"] for r in a["choice"]} == {"", int8, INT4, ctk}
    assert a["period_rows"] == b["period_rows"] and all("codec" not in r for r in a["period_rows"])
    assert a["options"]["compress"] == "auto (int4:warmup=0,block=256)" and a["options"]["H"].startswith(
        "auto"
    )
    # one codec on both: the references its changes are sent from stay one (and moved: it averaged)
    assert all(torch.equal(x, y) for x, y in zip(a["refs"], b["refs"], strict=True))
    assert a["refs_moved"] and a["refs_back"] and a["residual_back"]


def test_compress_auto_takes_a_plans_priced_codec_and_refuses_one_it_would_not_choose(tmp_path, capsys):
    """A plan made without ``--compress auto`` (``geotrain plan``'s, priced for fp32 or a named
    codec) gives a run at dreamddp's default the codec it was priced for, and the run says so;
    one priced for a codec auto never chooses (topk) is refused with the fix; one that chose is
    taken as it chose."""
    import json

    from geotrain.compress.codec import ConfigError

    model = _model()
    path = tmp_path / "plan.json"

    def built(plan):
        path.write_text(json.dumps(plan))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        return build_sync("dreamddp", model, opt, Communicator(), {"plan_path": str(path)})  # the default

    plain = built(_plan(model, 3))  # no models: priced for plain all-reduces
    assert plain.config.compress == "auto" and plain.codec is None and plain.codec_choice == []
    assert "--compress auto takes the plan's codec (none: fp32)" in capsys.readouterr().err
    plain.close()
    with pytest.raises(ConfigError, match="give the run --compress topk"):
        built(_plan(model, 3) | {"models": {"codec": "topk:warmup=0,ratio=0.01 x2"}})
    chosen = built(_plan(model, 3) | {"codec": INT4, "codec_choice": [{"codec": INT4}]})
    assert chosen.codec.spec() == INT4 and chosen.codec_choice == [{"codec": INT4}]
    assert len(chosen._ref) == len(chosen.layers)
    chosen.close()


def _train_steps(sync, opt, rank: int, steps: int, settle: bool = False) -> None:
    """``steps`` steps of ``sync``'s model on this worker's batches (``settle``: each step
    settled after, as ``Sync.step`` does)."""
    for step in range(steps):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        sync.before_step()
        opt.step()
        opt.zero_grad()
        sync.after_step()
        if settle:
            sync.settle()


def _replan_after_training(rank, world_size):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = build_sync("dreamddp", model, opt, Communicator(), {"H": 2, "replan_threshold": 0.1})

    def loss_fn():
        x, y = _batch(rank, 99)
        return model(x, y)[1]

    sync.prepare(loss_fn)
    sync.predicted_step_s = 1e-9  # the measured time will look like a drift
    _train_steps(sync, opt, rank, 4)
    sync.close()
    return {
        "replans": sync.replans,
        "iterations": sync.schedule.iterations,
        "opt_steps": opt.state[next(iter(model.parameters()))]["step"].item(),
    }


def test_replanning_mid_training_agrees_across_workers_and_leaves_the_optimizer_alone():
    a, b = run_workers(_replan_after_training, 2)
    # the second boundary re-plans (two periods in a row drifted); none before it
    assert a["replans"] == b["replans"] == 1
    assert a["iterations"] == b["iterations"]
    assert a["opt_steps"] == 4  # profiling timed a copy of the optimizer, not the real one


def _codec_run(rank, world_size):
    """DreamDDP with int4, profiled at start-up, 40 steps at the default threshold, on links
    that do not change: each iteration takes twice what the plan predicts, exactly (a clock
    that advances one tick per reading: the forward's start, then the step's end), so the
    drift is real and steady, not this machine's noise."""
    import functools
    import itertools
    from types import SimpleNamespace

    import geotrain.sync.dreamddp as dreamddp
    import geotrain.sync.dreamddp_plan as planning
    from geotrain.plan.profile import build_profile

    # Without the contention probe: the fake clock's blocked times are no measurement, and a
    # slowdown the probe read on this machine would make the slowdown's fit (a re-plan of its
    # own, once a run) disagree with it by chance.
    planning.build_profile = functools.partial(build_profile, contention=False)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = build_sync("dreamddp", model, opt, Communicator(), {"H": 4, "compress": "int4"})
    profiles = []

    def loss_fn():
        profiles.append(1)
        x, y = _batch(rank, 99)
        return model(x, y)[1]

    sync.prepare(loss_fn)
    profiled, first = len(profiles), sync.predicted_step_s
    ticks = itertools.count()
    dreamddp.time = SimpleNamespace(perf_counter=lambda: next(ticks) * 2 * first)
    try:
        _train_steps(sync, opt, rank, 40)
    finally:
        dreamddp.time = time
    sync.close()
    return {
        "replans": sync.replans,
        "reprofiles": sync.reprofiles,
        "profiled_again": len(profiles) > profiled,
        "predicted": (first, sync.predicted_step_s),
    }


@pytest.mark.timeout(120)
def test_a_run_with_a_codec_replans_at_most_once_and_never_profiles_again():
    """Steps steadily off the plan's prediction re-plan once, at the second drifting period,
    from the measured steps (no profile), to a plan that predicts them: none after it."""
    results = run_workers(_codec_run, 2, timeout=100)
    for r in results:
        assert r["replans"] == 1 and r["reprofiles"] == 0 and not r["profiled_again"]
    assert results[0]["predicted"] == results[1]["predicted"]


def _refs_after_rebind(rank, world_size):
    """A codec's references apart on one worker (a failure between two workers' landings), then
    the regroup's rebind: rank 0's are taken; where they already agree, nothing is sent."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"H": 2, "replan_threshold": 0.0, "compress": "int8"}
    sync = build_sync("dreamddp", model, opt, Communicator(), options)
    sync.set_plan(_plan(model, 2))
    _train_steps(sync, opt, rank, 3)  # the middle of a period: one iteration's averages in flight
    received = sync.comm.stats.recv_bytes
    sync.rebind()
    quiet = sync.comm.stats.recv_bytes - received  # the digest's two floats only
    if rank == 1:
        with torch.no_grad():
            next(iter(sync._ref.values()))[0].add_(1.0)
    received = sync.comm.stats.recv_bytes
    sync.rebind()
    mended = sync.comm.stats.recv_bytes - received
    refs = [t.clone() for layer in sync.layers for t in sync._ref[layer.name]]
    # what an admission's audit reads: the references (the replicas differ mid-period)
    digests = (tensors_digest(sync.shared_state()), param_digest(sync.model))
    # the end-of-run average makes one model, and the references follow it: a worker whose own
    # average failed adopts a finished one's state and starts from them
    sync.finalize()
    pairs = [
        (p, ref) for layer in sync.layers for p, ref in zip(layer.params, sync._ref[layer.name], strict=True)
    ]
    final = all(torch.equal(p, ref) for p, ref in pairs)
    sync.close()
    plain_model = _model()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=LR)
    plain = build_sync("dreamddp", plain_model, plain_opt, Communicator(), {"H": 2, "compress": "none"})
    nothing = plain.shared_state()  # no codec: each layer averaged at its own iteration
    plain.close()
    return quiet, mended, refs, digests, nothing, final


def test_a_regroup_gives_every_worker_one_reference_for_a_codecs_changes():
    results = run_workers(_refs_after_rebind, 2)
    (quiet0, _, refs0, digests0, nothing0, final0), (quiet1, mended1, refs1, digests1, _, final1) = results
    assert final0 and final1
    nbytes = sum(t.numel() * 4 for t in refs0)
    assert quiet0 < 100 and quiet1 < 100
    assert mended1 >= nbytes
    for a, b in zip(refs0, refs1, strict=True):
        assert torch.equal(a, b)
    assert digests0[0] == digests1[0] and digests0[1] != digests1[1]  # shared: the references
    assert nothing0 is None


@pytest.mark.parametrize("saved", ["", "int8"])
def test_a_run_saved_before_auto_was_the_default_resumes_sending_what_it_sent(saved):
    """A state saved with ``compress`` "" (fp32, the default before) or a named codec, loaded
    into a run at today's default (``auto``): it goes on with what it sent, its codec's
    residuals and references restored, and chooses nothing."""
    model = _model()
    old = build_sync(
        "dreamddp", model, torch.optim.SGD(model.parameters(), lr=LR), Communicator(), {"compress": saved}
    )
    old.set_plan(_plan(model, 3))
    state = old.state_dict()
    old.close()
    new = build_sync("dreamddp", _model(), torch.optim.SGD(model.parameters(), lr=LR), Communicator(), {})
    assert new.config.compress == "auto"
    new.load_state_dict(state)
    assert new.config.compress == saved and new.codec_choice is None
    assert (new.codec.spec() if new.codec else "") == (old.codec.spec() if old.codec else "")
    if saved:
        refs = [(a, b) for name, ts in state["ref"].items() for a, b in zip(new._ref[name], ts, strict=True)]
        assert refs and all(torch.equal(a, b) for a, b in refs)
    new.close()
