"""``--H-schedule``: the periods of localsgd and diloco, shorter first, then H (sync/periods.py).
Pure logic and a fake communicator: the syncs fall exactly where the schedule says."""

from __future__ import annotations

import pytest
import torch

from geotrain.ft.elastic import StepStatus, next_boundary
from geotrain.models.gpt import GPT, gpt_config
from geotrain.sync import ConfigError, build_sync, sync_config
from geotrain.sync.periods import Periods, periods_for, resolve_every
from geotrain.train import TrainConfig
from test_units import FakeCommunicator, _step


def test_grow_takes_the_divisors_of_H_each_at_least_twice_the_last():
    assert periods_for("grow:every=40", 10) == Periods((0, 40, 80), (2, 5, 10))
    assert periods_for("grow:every=40", 16) == Periods((0, 40, 80, 128), (2, 4, 8, 16))
    assert periods_for("grow:every=30,start=3", 12) == Periods((0, 30, 60), (3, 6, 12))
    # after a warm start of 5: the first stage begins at step 5, and 4 comes in at 48 (a multiple
    # of both 2 and 4 at or after 5 + 40)
    assert periods_for("grow:every=40", 20, warm_start=5) == Periods((5, 48, 100, 140), (2, 4, 10, 20))
    assert periods_for("", 10) == Periods.fixed(10)
    with pytest.raises(ConfigError, match="H=7 has none"):
        periods_for("grow:every=5", 7)


def test_a_stage_ends_where_both_periods_divide_the_step_count():
    periods = periods_for("2x4,5x5", 10)  # 2 until 10 (lcm 10), 5 until 20 (10 + 5, lcm 10), then 10
    assert periods == Periods((0, 10, 20), (2, 5, 10))
    assert periods.boundaries(0, 41) == [2, 4, 6, 8, 10, 15, 20, 30, 40]
    assert [periods.period(s) for s in (0, 9, 10, 19, 20, 99)] == [2, 2, 5, 5, 10, 10]
    assert periods.common_multiple() == 10
    assert periods.describe() == "H 2 from step 0, 5 from step 10, 10 from step 20"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("3x", "PERIODxSTEPS"),
        ("x5", "PERIODxSTEPS"),
        ("2x5,0x3", "got '0x3' in '2x5,0x3'"),
        ("grow:every=0", "got 'every=0'"),
        ("grow:step=4", "got 'step=4'"),
        ("grow", "give grow:every=STEPS"),  # the training config resolves it; the API must give it
        ("5x10,2x10", "the periods must rise, each below the next and below H=10 .got 5, 2, 10"),
        ("20x5", "must rise, each below the next and below H=10"),
        ("3x5", "a stage of 3 ends where both 3 and 10 sync, a multiple of 30"),  # fine: 30 <= 4 H
        ("7x5", "a multiple of 70, over 4 H late"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(spec, message):
    if spec == "3x5":
        assert sync_config("localsgd", {"H": 10, "H_schedule": spec}).H_schedule == "3x5"
        return
    with pytest.raises(ConfigError, match=message):
        sync_config("localsgd", {"H": 10, "H_schedule": spec})


def test_grow_is_resolved_once_from_the_planned_steps():
    assert resolve_every("grow", 400) == "grow:every=40"
    assert resolve_every("grow:start=3", 2000) == "grow:start=3,every=200"
    assert resolve_every("grow:every=7", 2000) == "grow:every=7"
    assert resolve_every("2x5", 100) == "2x5"
    cfg = TrainConfig(algo="diloco", steps=400, H_schedule="grow")
    assert cfg.H_schedule == "grow:every=40" and cfg.sync_config().H_schedule == "grow:every=40"
    assert TrainConfig(algo="localsgd", steps=400, lr_steps=1000, H_schedule="grow").H_schedule == (
        "grow:every=100"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"algo": "ssgd"}, "ssgd does not take --H-schedule .* algorithms that do: localsgd, diloco"),
        ({"algo": "dreamddp"}, "dreamddp does not take --H-schedule"),
        ({"algo": "sparseloco"}, "sparseloco does not take --H-schedule"),
        ({"algo": "localsgd", "pace": "time", "max_norm_ratio": 0.0}, "drop --H-schedule, or --pace time"),
        ({"algo": "diloco", "site_H": 2, "hierarchy": "auto"}, "or --pace time and --site-H"),
    ],
)
def test_the_schedule_is_for_localsgd_and_diloco_with_a_fixed_pace(options, message):
    """Refused by the training config, in the launcher: before any worker starts."""
    with pytest.raises(ConfigError, match=message):
        TrainConfig(H_schedule="2x4", **options)


def _tiny():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", 256, 16))


@pytest.mark.parametrize("algo", ["localsgd", "diloco"])
@pytest.mark.parametrize(
    "options, synced_at",
    [
        # 2 for at least 4 steps (to 10, where 2 and 5 both sync), 5 for 5 more (to 20), then 10
        ({"H": 10, "H_schedule": "2x4,5x5"}, [2, 4, 6, 8, 10, 15, 20, 30, 40]),
        # a warm start of 3 first: every step to 3, then 2 from there until 12 (lcm 6), then 6
        ({"H": 6, "H_schedule": "2x4", "warm_start": 3}, [1, 2, 3, 4, 6, 8, 10, 12, 18, 24, 30, 36]),
    ],
)
def test_the_syncs_and_their_steps_are_exactly_as_configured(algo, options, synced_at):
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = FakeCommunicator()
    sync = build_sync(algo, model, opt, comm, options | {"compress": "none"})  # the fake has no all-to-all
    synced, periods = [], []
    for s in range(41):
        periods.append(sync.sync_period())  # what the membership layer sees before the step
        if _step(sync, opt, s):
            synced.append(s + 1)
    assert synced == synced_at
    assert sync.syncs == len(synced_at)
    n_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert comm.stats.payload_bytes == len(synced_at) * n_param_bytes
    # the next boundary from any step is the next multiple of the period in force there
    for s, period in enumerate(periods):
        if options.get("warm_start", 0) <= s < synced_at[-1]:
            assert -(-(s + 1) // period) * period == min(b for b in synced_at if b > s)
    # the first boundary of every stage at least 50 steps on (base.MIN_SNAPSHOT_EVERY)
    assert sync.default_snapshot_every() == (50 if options["H"] == 10 else 54)
    assert "period H 2 from step" in sync.info()


def test_after_a_regroup_each_heads_for_its_own_periods_next_boundary():
    S = StepStatus
    # --H-schedule 2x4,5x5 with H=10: one survivor at step 9 (period 2), the leader at 13
    # (period 5). Those behind take the leader's step and period: 15, not 14 (no sync under 5).
    assert next_boundary([S(9, False), S(13, False)], [0], [2, 5]) == 15
    # a joiner (step -1) reports its fresh period; it is behind and takes the leader's
    assert next_boundary([S(-1, False), S(21, False)], [0], [2, 10]) == 30


def test_diloco_s_outer_momentum_follows_the_period_in_force_unless_set():
    """At H=50 the momentum that follows H is 0.74; the stages of 2 and 10 before it are
    stepped at their own (0.3, the multiple 1 at the outer lr of H=50, 0.7; and 0.5); with
    the ramp (the default), each outer step's is that value
    ramped by the outer steps taken. A momentum given stays as given."""
    from geotrain.sync.diloco import outer_momentum_for, ramped_momentum

    for ramp in (0, 4):
        model = _tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        options = {"H": 50, "H_schedule": "2x2,10x10", "momentum_ramp": ramp}
        sync = build_sync("diloco", model, opt, FakeCommunicator(), options | {"compress": "none"})
        seen = []
        for s in range(100):
            if _step(sync, opt, s):
                seen.append((s + 1, sync.outer_optimizer.param_groups[0]["momentum"]))
        # 2 to step 10 (where 2 and 10 both sync), 10 to 50 (where 10 and 50 do), then 50
        assert [step for step, _ in seen] == [2, 4, 6, 8, 10, 20, 30, 40, 50, 100]
        periods = [2, 2, 2, 2, 2, 10, 10, 10, 10, 50]
        assert [m for _, m in seen] == [
            ramped_momentum(outer_momentum_for(p), k, ramp) for k, p in enumerate(periods)
        ]
        if not ramp:
            assert seen[0][1] == outer_momentum_for(2) == 0.3 and seen[8][1] == outer_momentum_for(10) == 0.5
            assert seen[-1][1] == outer_momentum_for(50) == 0.74
    options = {"H": 50, "H_schedule": "2x2", "outer_momentum": 0.9}
    fixed = build_sync("diloco", _tiny(), opt, FakeCommunicator(), options | {"compress": "none"})
    assert [_step(fixed, opt, s) for s in range(2)] == [False, True]
    assert fixed.outer_optimizer.param_groups[0]["momentum"] == 0.9
