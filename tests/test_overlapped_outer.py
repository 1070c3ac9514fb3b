"""Streaming DiLoCo and CO2: outer synchronisation hidden under inner steps.

Pure logic first (configs, the fragments, the schedule, CO2's clip), then real gloo groups of 3
checked against closed forms: a Streaming DiLoCo fragment lands as the mean of the replicas
(mixed with the local steps taken meanwhile), and CO2's anchor takes the stale mean one period
late; the replicas end bitwise equal. Resume and survival are in test_resume_gloo.py and
test_continue_cli.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import geotrain.plan.profile as profile_module
import geotrain.sync.co2 as co2_module
import geotrain.sync.streaming as streaming_module
from geotrain.comm.buckets import flatten
from geotrain.comm.communicator import Communicator
from geotrain.compress.quantize import Int4
from geotrain.models.gpt import GPT, gpt_config
from geotrain.plan.cost import LinkModel
from geotrain.plan.gather import gather_s, predict_streaming, quantized_message_bytes, streaming_tau
from geotrain.sync import ConfigError, build_sync, sync_config
from geotrain.sync.base import InFlight
from geotrain.sync.streaming import fragment_units, strided_fragments
from geotrain.train_config import AUTO_TAU, TrainConfig
from helpers import Cases, refused, run_workers


def _tiny(algo: str, options: dict, comm: Communicator | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(gpt_config("tiny", 256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, build_sync(algo, model, opt, comm or Communicator(), options)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 256, (2, 16), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def _train_step(sync, opt, rank: int, step: int) -> bool:
    x, y = _batch(rank, step)
    sync.model(x, y)[1].backward()
    sync.before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sync.after_step()


# -- pure logic ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algo, options, needle",
    [
        ("streaming", {"H": 10, "fragments": 4}, "must be a multiple of --fragments 4"),
        ("streaming", {"H": 8, "fragments": 4, "tau": 2}, "must be auto or in [0, H / fragments) = [0, 2)"),
        ("streaming", {"tau": -1}, "must be auto or in [0, H / fragments) = [0, 5)"),
        ("streaming", {"tau": "soon"}, "must be auto or in [0, H / fragments) = [0, 5)"),
        ("sparseloco", {"tau": "auto"}, "or 0 for auto; got auto"),
        ("streaming", {"mix": 1.5}, "--mix (weight of the local parameters) must be in [0, 1]"),
        ("streaming", {"bits": 2}, "--bits for streaming must be one of (4, 8, 32)"),
        ("streaming", {"fragments": 0}, "--fragments must be an integer >= 1"),
        ("streaming", {"carry": True, "mix": 0.3}, "--carry replaces --mix"),
        ("streaming", {"carry": True, "tau": 0}, "raise --tau or drop --carry"),
        ("diloco", {"carry": True}, "diloco does not take --carry; algorithms that do: streaming"),
        ("diloco", {"eager": True}, "diloco does not take --eager; algorithms that do: co2"),
        ("co2", {"carry": False}, "co2 does not take --carry"),
        ("streaming", {"eager": False}, "streaming does not take --eager"),
        ("co2", {"gap_penalty": 0.5}, "stale pseudo-gradient) must be >= 1"),
        ("co2", {"clip": -1.0}, "--clip (outer momentum threshold; 0: off) must be >= 0"),
        ("co2", {"outer_momentum": 1.0}, "--outer-momentum must be in [0, 1)"),
        ("co2", {"bits": 2}, "--bits for co2 must be one of (4, 8, 32)"),
        ("co2", {"eager_weight": 2.5}, "--eager-weight must be a number in [0, 2], got 2.5"),
        ("co2", {"eager_weight": "most"}, "--eager-weight must be a number in [0, 2], got 'most'"),
        ("co2", {"eager": False, "eager_weight": 0.5}, "--eager-weight needs --eager"),
        ("diloco", {"eager_weight": 0.5}, "diloco does not take --eager-weight; algorithms that do: co2"),
        ("diloco", {"tau": 2}, "diloco does not take --tau; algorithms that do: sparseloco, streaming, co2"),
        ("co2", {"H": 10, "tau": 0}, "--tau for co2 (steps into the next period at which a period's mean "),
        ("co2", {"H": 10, "tau": 11}, "must be auto or in [1, H] = [1, 10], got 11"),
        ("co2", {"tau": "soon"}, "must be auto or in [1, H] = [1, 10], got soon"),
        ("co2", {"tau": True}, "must be auto or in [1, H] = [1, 10], got True"),
        ("co2", {"eager_weight": True}, "--eager-weight must be a number in [0, 2], got True"),
        ("sparseloco", {"clip": 0.0}, "sparseloco does not take --clip; algorithms that do: co2"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_with_what_to_change(algo, options, needle):
    with pytest.raises(ConfigError, match=None) as e:
        sync_config(algo, options)
    assert needle in str(e.value)


def test_carry_reaches_streaming_from_the_command_line_config():
    from geotrain.train import TrainConfig

    default = TrainConfig(algo="streaming").sync_config()
    assert default.carry is True and default.mix is None  # on by default
    assert TrainConfig(algo="streaming", carry=True).sync_config().carry is True
    for off in (TrainConfig(algo="streaming", mix=0.5), TrainConfig(algo="streaming", carry=False)):
        assert off.sync_config().carry is False and off.sync_config().mix == 0.5
    at_once = TrainConfig(algo="streaming", tau=0).sync_config()  # nothing in flight to carry
    assert at_once.carry is False and at_once.mix == 0.5


@pytest.mark.parametrize(
    "compute_s, gather, every, tau",
    [
        (1.0, 0.0, 5, 1),  # nothing to hide: one step, as the fixed default
        (1.0, 0.6, 5, 1),  # 0.9 steps
        (1.0, 1.0, 5, 2),  # 1.5 steps
        (1.0, 2.0, 5, 3),  # 3.0 steps exactly (no rounding up past it)
        (1.0, 100.0, 5, 4),  # never one fragment past the next one's launch
        (1.0, 100.0, 2, 1),
        (1.0, 5.0, 1, 0),  # no step to overlap
        (0.0, 1.0, 5, 4),
    ],
)
def test_tau_auto_takes_the_fewest_steps_that_cover_one_and_a_half_gathers(compute_s, gather, every, tau):
    assert streaming_tau(compute_s, gather, every) == tau


def test_the_planner_prices_tau_auto_at_the_tau_it_would_take():
    n, workers, compute_s = 10_900_000, 4, 1.2  # W1
    for rate, expected in ((100e6, 1), (20e6, 3)):  # a fragment's gather of 4.2 MB: 0.35 s, 1.7 s
        link = LinkModel(0.01, 2 * (workers - 1) / workers * 8 / rate)  # a ring all-reduce's line
        gather = gather_s(link, quantized_message_bytes(-(-n // 4), 4), workers)
        assert streaming_tau(compute_s, gather, 5) == expected
    tau = 3
    auto = predict_streaming(compute_s, link, n, workers, 20, 4, "auto", 4)
    assert auto == predict_streaming(compute_s, link, n, workers, 20, 4, tau, 4)
    assert auto < predict_streaming(compute_s, link, n, workers, 20, 4, 1, 4)


def test_tau_auto_reaches_streaming_from_the_command_line_and_back():
    auto = TrainConfig(algo="streaming", tau=AUTO_TAU)
    cfg = auto.sync_config()
    assert cfg.tau_auto and cfg.tau == 1 and cfg.carry is True  # 1 until the probe, with carry
    argv = auto.to_argv()
    assert argv[argv.index("--tau") + 1] == "auto"
    one_step = TrainConfig(algo="streaming", tau=AUTO_TAU, H=4).sync_config()  # a fragment every step
    assert not one_step.tau_auto and one_step.tau == 0 and one_step.carry is False


def test_a_carried_fragment_of_one_parameter_keeps_its_steps():
    """One worker, outer lr 1, no momentum: theta_f lands on x_f at launch, so a carried fragment
    is x_f at landing again, every fragment, also one of a single tensor (the embeddings of
    ``tiny`` in 6 fragments), whose flat view must not stand in for its value at launch."""
    _, opt, sync = _tiny("streaming", {"H": 12, "fragments": 6, "tau": 1, "carry": True, "bits": 32,
                                       "outer_lr": 1.0, "outer_momentum": 0.0})  # fmt: skip
    assert any(len(fragment) == 1 for fragment in sync.fragments)
    landed = set()
    for step in range(1, 13):
        x, y = _batch(0, step)
        sync.model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        before = [sync._local(f).clone() for f in range(6)]  # (the buggy view would move with it)
        if sync.after_step():
            f = sync._landing(step)
            landed.add(f)
            torch.testing.assert_close(sync._local(f), before[f], atol=1e-6, rtol=0)
    assert landed == set(range(6))
    sync.close()


def test_streaming_error_feedback_stays_honest_under_chaos_restarts_where_left_out_and_ends_sent():
    """With 4-bit messages: a --chaos-spoiled message leaves the residual the honest one would
    have; a message left out of the mean drops what its rounding lost; ``finalize`` sends each
    fragment's last residual with its Delta_f (theta_f - decoded(theta_f - x_f + e_f)), then
    holds none."""
    options = {"H": 4, "fragments": 2, "tau": 1, "bits": 4}
    _, opt, sync = _tiny("streaming", options)
    _, honest_opt, honest = _tiny("streaming", options)
    sync.comm.corrupt_next = "signflip"
    _train_step(sync, opt, 0, 1)  # launches fragment 0
    _train_step(honest, honest_opt, 0, 1)
    assert not sync.comm.corrupt_next  # spent on this message
    assert not torch.equal(sync.in_flight.saved(), honest.in_flight.saved())
    assert torch.equal(sync._residual[0], honest._residual[0]) and sync._residual[0].any()
    real_mean = sync.messages.mean
    sync.messages.mean = lambda gathered, n: (real_mean(gathered, n)[0], [False])  # left out
    _train_step(sync, opt, 0, 2)  # fragment 0 lands
    _train_step(honest, honest_opt, 0, 2)
    assert not sync._residual[0].any() and honest._residual[0].any()
    assert not honest.in_flight.flying
    codec = Int4()
    expected = [
        theta - codec.roundtrip(theta - honest._local(f) + honest._residual[f])
        for f, theta in enumerate(honest._global)
    ]
    assert honest._residual[0].any()
    honest.finalize()
    for f, want in enumerate(expected):
        torch.testing.assert_close(honest._local(f), want, atol=1e-6, rtol=0)
    assert not any(r.any() for r in honest._residual)
    sync.close()
    honest.close()


def test_error_feedback_residuals_are_fp32_under_bf16_parameters():
    """What a message's rounding lost is kept in fp32 from the start: a residual made in the
    parameters' bf16 would round the fp32 one a resume copies back into it."""
    for algo in ("streaming", "co2"):
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", 256, 16)).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = build_sync(algo, model, opt, Communicator(), {"bits": 4})
        residuals = sync._residual if algo == "streaming" else [sync._residual]
        assert all(r.dtype == torch.float32 for r in residuals), algo
        sync.close()


def test_more_fragments_than_the_model_has_units_is_refused():
    with pytest.raises(ConfigError, match="more than the model's 6 units"):
        _tiny("streaming", {"H": 8, "fragments": 8, "tau": 0})


def test_fragments_hold_every_parameter_once_with_blocks_strided():
    model = GPT(gpt_config("mini"))
    blocks, others = fragment_units(model)
    assert len(blocks) == 6 and len(others) == 4  # wte, wpe, ln_f, lm_head
    frags = strided_fragments(model, 4)
    ids = [id(p) for f in frags for p in f]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    for i, block in enumerate(model.blocks):
        (home,) = [f for f, frag in enumerate(frags) if id(block.attn.c_attn.weight) in map(id, frag)]
        assert home == i % 4
        assert all(id(p) in map(id, frags[home]) for p in block.parameters())  # a block is never split


def test_the_fragments_land_in_turn_each_launched_tau_steps_before():
    _, _, sync = _tiny("streaming", {"H": 12, "fragments": 3, "tau": 2})
    lands = {t: sync._landing(t) for t in range(1, 25) if sync._landing(t) is not None}
    launches = {t: sync._launching(t) for t in range(1, 25) if sync._launching(t) is not None}
    assert lands == {4: 0, 8: 1, 12: 2, 16: 0, 20: 1, 24: 2}
    assert launches == {2: 0, 6: 1, 10: 2, 14: 0, 18: 1, 22: 2}
    assert sync.sync_period() == 2  # launches and landings are all at multiples of 2


def test_each_streaming_fragments_momentum_ramps_over_its_own_outer_steps():
    """Where the momentum follows H (0.5 at H=4), each fragment's rises to 0.9 over its own first
    ``momentum_ramp`` landings (2 here), as DiLoCo's does; the fragments land in turn, so after 2k
    landings each has taken k. A momentum given stays as given."""
    _, opt, sync = _tiny("streaming", {"H": 4, "fragments": 2, "tau": 0, "momentum_ramp": 2})
    seen = []
    for step in range(1, 13):
        if _train_step(sync, opt, 0, step):
            f = _landing(step)
            seen.append((f, sync.outer_optimizers[f].param_groups[0]["momentum"]))
    assert [f for f, _ in seen] == [0, 1] * 3
    assert [m for _, m in seen] == pytest.approx([0.5, 0.5, 0.7, 0.7, 0.9, 0.9])
    _, opt, fixed = _tiny("streaming", {"H": 4, "fragments": 2, "tau": 0, "outer_momentum": 0.3})
    for step in range(1, 7):
        _train_step(fixed, opt, 0, step)
    assert [o.param_groups[0]["momentum"] for o in fixed.outer_optimizers] == [0.3, 0.3]
    for s in (sync, fixed):
        s.close()


def test_co2_clips_the_outer_momentum_in_place():
    """The public CO2 code calls torch.clamp without keeping its result: it never clips. Here a
    pseudo-gradient of 0.5 per entry under a threshold of 0.01 leaves a momentum of exactly 0.01."""
    _, _, sync = _tiny("co2", {"H": 1, "clip": 0.01, "outer_momentum": 0.5, "outer_lr": 1.0})
    anchor = sync._anchor.clone()
    big = torch.full_like(anchor, 0.5)
    big[::2] = -0.5
    sync._outer_update(big)
    assert torch.equal(sync._momentum.abs(), torch.full_like(anchor, 0.01))
    torch.testing.assert_close(sync._anchor, anchor - sync._momentum)
    _, _, free = _tiny("co2", {"H": 1, "clip": 0.0, "gap_penalty": 2.0})
    free._outer_update(big)
    assert torch.equal(free._momentum, big / 2)  # clip 0: off; the penalty divides


# -- real gloo groups -----------------------------------------------------------------------------
def _streaming_run(
    rank: int,
    world_size: int,
    tau: int,
    mix: float | None,
    bits: int,
    momentum: float = 0.0,
    carry: bool = False,
) -> dict:
    """8 steps of H 4 in 2 fragments (one lands every 2 steps), outer lr 1; per step each
    fragment's flat values before and after the sync, and theta before it."""
    options = {"H": 4, "fragments": 2, "tau": tau, "mix": mix, "outer_lr": 1.0, "outer_momentum": momentum}
    options |= {"carry": True, "mix": None} if carry else {}
    model, opt, sync = _tiny("streaming", options | {"bits": bits}, Communicator())
    frags = range(len(sync.fragments))
    records = []
    for step in range(1, 9):
        before = sync.comm.stats.sent_bytes
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        record = {"theta": [t.clone() for t in sync._global], "local": [sync._local(f) for f in frags]}
        sync.after_step()
        record |= {"after": [sync._local(f) for f in frags], "sent": sync.comm.stats.sent_bytes - before}
        records.append(record)
    sync.finalize()
    return {"records": records, "final": [sync._local(f) for f in frags]}


def _co2_run(rank: int, world_size: int, eager: bool, bits: int = 32, weight: float = 1.0, tau=2) -> dict:
    options = {
        "tau": tau,
        "eager_weight": weight,
        "bits": bits,
        "H": 2,
        "outer_lr": 0.8,
        "outer_momentum": 0.5,
        "gap_penalty": 2.0,
        "clip": 1.0,
        "eager": eager,
    }
    model, opt, sync = _tiny("co2", options, Communicator())
    records = []
    for step in range(1, 8):
        x, y = _batch(rank, step)
        sync.model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        local = sync._local()
        anchor = sync._anchor.clone()
        before = sync.comm.stats.sent_bytes
        sync.after_step()
        sent = sync.comm.stats.sent_bytes - before
        records.append({"local": local, "anchor": anchor, "after": sync._local(), "sent": sent})
    sync.finalize()
    return {"records": records, "final": sync._local()}


def _either(rank: int, world_size: int, algo: str, *args) -> dict:
    return (_streaming_run if algo == "streaming" else _co2_run)(rank, world_size, *args)


# One group of 3 processes runs every case (a group per case spends its time starting them).
RUNS = Cases(
    _either,
    3,
    [
        ("streaming", 0, 0.0, 32),
        ("streaming", 1, 0.5, 32),
        ("streaming", 1, 0.5, 4),
        ("streaming", 0, 0.0, 32, 0.5),
        ("streaming", 1, None, 32, 0.0, True),
        ("co2", False),
        ("co2", True),
        ("co2", True, 4),
        ("co2", True, 32, 0.5),
        ("co2", True, 32, 1.0, 1),
        ("co2", True, 4, 1.0, 1),
        ("co2", False, 32, 1.0, 1),
    ],
)


def _landing(step: int) -> int | None:
    return (step // 2 - 1) % 2 if step % 2 == 0 else None


def test_a_streaming_fragment_lands_as_the_mean_of_the_replicas():
    """tau 0, mix 0, outer lr 1 without momentum, fp32: each landing is local SGD on one fragment
    (every 2 steps, fragments in turn): that fragment becomes the mean of the replicas, bitwise
    equal everywhere; the other keeps each worker's own values."""
    ranks = RUNS.get("streaming", 0, 0.0, 32)
    for i in range(8):
        recs = [r["records"][i] for r in ranks]
        for f in (0, 1):
            if f == _landing(i + 1):
                mean = torch.stack([rec["local"][f] for rec in recs]).mean(dim=0)
                for rec in recs:
                    torch.testing.assert_close(rec["after"][f], mean, atol=1e-6, rtol=1e-6)
                    assert torch.equal(rec["after"][f], recs[0]["after"][f])
            else:
                assert all(torch.equal(rec["after"][f], rec["local"][f]) for rec in recs)
        assert recs[0]["sent"] == (2 * 4 * recs[0]["local"][_landing(i + 1)].numel() if i % 2 else 0)
    assert all(torch.equal(a, b) for r in ranks for a, b in zip(r["final"], ranks[0]["final"], strict=True))
    assert not torch.equal(ranks[0]["records"][-1]["local"][0], ranks[1]["records"][-1]["local"][0])


def test_each_fragment_takes_its_own_nesterov_outer_step():
    """tau 0, mix 0, outer lr 1 with Nesterov momentum 0.5: fragment f's theta moves by g + 0.5 b,
    b <- 0.5 b + g its own momentum (g the mean pseudo-gradient), and every replica takes theta."""
    ranks = RUNS.get("streaming", 0, 0.0, 32, 0.5)
    buffers: dict[int, torch.Tensor] = {}
    for i in range(1, 8, 2):
        f = _landing(i + 1)
        recs = [r["records"][i] for r in ranks]
        theta = recs[0]["theta"][f]
        g = torch.stack([theta - rec["local"][f] for rec in recs]).mean(dim=0)
        buffers[f] = g if f not in buffers else 0.5 * buffers[f] + g
        expected = theta - (g + 0.5 * buffers[f])
        for rec in recs:
            torch.testing.assert_close(rec["after"][f], expected, atol=1e-6, rtol=1e-5)
            assert torch.equal(rec["after"][f], recs[0]["after"][f])
    assert sorted(buffers) == [0, 1]


@pytest.mark.parametrize("carry", [False, True])
def test_a_streaming_adopter_starts_every_fragment_from_theta_so_no_progress_counts_twice(carry):
    """A joiner (or a survivor behind) loads a member's replica, which holds the member's
    progress since each fragment's last sync. Kept, that progress would be in both workers'
    Delta_f at the fragment's next landing: counted twice. The adopter restarts each fragment
    from theta_f and takes part in the gather in flight with an empty message, with no residual
    of the member's rounding; with --carry, what it carries at that landing is its own steps
    from theta_f, not the member's since its launch."""
    options = {"H": 8, "fragments": 4, "tau": 1, "carry": carry}
    member, member_opt, member_sync = _tiny("streaming", options)
    for step in range(3):  # fragment 0 landed after step 2; fragment 1 is in flight
        _train_step(member_sync, member_opt, 0, step)
    assert member_sync.in_flight.flying
    moved = [not torch.equal(member_sync._local(f), theta) for f, theta in enumerate(member_sync._global)]
    assert sum(moved) >= 3  # the member's replica is ahead of theta in the unsynced fragments
    joiner, joiner_opt, joiner_sync = _tiny("streaming", options, seed=1)
    joiner.load_state_dict(member.state_dict())
    joiner_sync.load_state_dict(member_sync.state_dict())
    assert any(r.any() for r in joiner_sync._residual)  # the member's rounding, loaded
    joiner_sync.adopted_state()
    for f, theta in enumerate(joiner_sync._global):
        assert torch.equal(theta, member_sync._global[f])
        assert torch.equal(joiner_sync._local(f), theta)  # its next Delta_f is its own progress only
    assert not any(r.any() for r in joiner_sync._residual)
    if carry:  # fragment 1 in flight: the member carries from its launch, the adopter from theta_1
        start = joiner_sync._launched_from
        assert joiner_sync._in_flight_fragment() == member_sync._in_flight_fragment() == 1
        assert torch.equal(start, member_sync._global[1])
        assert not torch.equal(member_sync._launched_from, start)
    else:
        assert joiner_sync._launched_from is None
    member_sync.rebind()
    assert not joiner_sync.in_flight.saved().any() and member_sync.in_flight.saved().any()
    member_sync.close()
    # The adopter's step 4, then fragment 1 lands: the mean of its empty message is 0 and it is
    # fragment 1's first outer step, so theta_1 stays; carried, the adopter keeps its own step.
    theta = joiner_sync._global[1].clone()
    x, y = _batch(1, 4)
    joiner_sync.model(x, y)[1].backward()
    joiner_sync.before_step()
    joiner_opt.step()
    joiner_opt.zero_grad(set_to_none=True)
    stepped = joiner_sync._local(1)
    assert joiner_sync.after_step() and torch.equal(joiner_sync._global[1], theta)
    want = stepped if carry else 0.5 * stepped + 0.5 * theta
    torch.testing.assert_close(joiner_sync._local(1), want, atol=1e-6, rtol=0)
    joiner_sync.close()


@pytest.mark.parametrize("bits", [32, 4])
def test_an_overlapped_fragment_mixes_the_local_steps_taken_in_flight(bits):
    """tau 1, mix 0.5: the fragment landing after step 2k was sent after step 2k-1, so theta
    becomes theta - mean_r(Delta_r), Delta_r = theta - x_r(2k-1) (each decoded from its 4-bit
    message where bits=4, of Delta plus what the fragment's last message's rounding lost: error
    feedback), and each worker's fragment 0.5 x_r(2k) + 0.5 theta; each worker sends its message
    N-1 = 2 times, at the launch."""
    ranks = RUNS.get("streaming", 1, 0.5, bits)
    codec = Int4()
    residuals: dict[tuple[int, int], torch.Tensor] = {}  # (rank, fragment): error feedback
    for i in range(1, 8, 2):  # the landings after steps 2, 4, 6, 8
        f = _landing(i + 1)
        launch = [r["records"][i - 1] for r in ranks]
        theta = launch[0]["theta"][f]
        deltas = [theta - rec["local"][f] for rec in launch]
        if bits == 4:  # each message of Delta plus what the fragment's last one's rounding lost
            meant = [d + residuals.get((r, f), torch.zeros_like(d)) for r, d in enumerate(deltas)]
            deltas = [codec.roundtrip(m) for m in meant]
            residuals |= {(r, f): m - q for r, (m, q) in enumerate(zip(meant, deltas, strict=True))}
        theta = theta - torch.stack(deltas).mean(dim=0)
        for r in ranks:
            rec = r["records"][i]
            torch.testing.assert_close(
                rec["after"][f], 0.5 * rec["local"][f] + 0.5 * theta, atol=1e-6, rtol=1e-5
            )
            assert torch.equal(rec["after"][1 - f], rec["local"][1 - f])
        n = theta.numel()
        block, chunk = codec.layout(n, 1)
        assert launch[0]["sent"] == 2 * (4 * n if bits == 32 else codec.row_bytes(chunk, block))
    assert all(torch.equal(a, b) for r in ranks for a, b in zip(r["final"], ranks[0]["final"], strict=True))


def test_a_carried_fragment_is_the_new_theta_plus_the_steps_taken_in_flight():
    """--carry, tau 1: the fragment landing after step 2k was sent after step 2k-1; it becomes
    theta - mean_r(Delta_r) plus what each worker's step 2k moved it (x_r(2k) - x_r(2k-1)), in
    place of the mix: every replica re-synchronised, no step lost."""
    ranks = RUNS.get("streaming", 1, None, 32, 0.0, True)
    for i in range(1, 8, 2):  # the landings after steps 2, 4, 6, 8
        f = _landing(i + 1)
        launch = [r["records"][i - 1] for r in ranks]
        theta = launch[0]["theta"][f]
        theta = theta - torch.stack([theta - rec["local"][f] for rec in launch]).mean(dim=0)
        for r, start in zip(ranks, launch, strict=True):
            rec = r["records"][i]
            carried = theta + (rec["local"][f] - start["local"][f])
            torch.testing.assert_close(rec["after"][f], carried, atol=1e-6, rtol=1e-5)
            assert torch.equal(rec["after"][1 - f], rec["local"][1 - f])
    assert all(torch.equal(a, b) for r in ranks for a, b in zip(r["final"], ranks[0]["final"], strict=True))


CO2_CASES = [(False, 32, 1.0, 2), (True, 32, 1.0, 2), (True, 4, 1.0, 2), (True, 32, 0.5, 2)]
CO2_CASES += [(True, 32, 1.0, 1), (True, 4, 1.0, 1), (False, 32, 1.0, 1)]


@pytest.mark.parametrize("eager, bits, weight, tau", CO2_CASES)
def test_co2_takes_each_period_mean_late_with_its_penalty_and_momentum(eager, bits, weight, tau):
    """H 2: the period's mean pseudo-gradient (sent at step 2k) lands tau steps later, a period
    late at tau = H = 2, at step 2k + 1 at tau 1: m <- 0.5 m + mean / 2 (clamped to +-1),
    A <- A - 0.8 m, bitwise on every worker. Each worker starts the next period from A, or
    (eager) from A - 0.4 w x its own pseudo-gradient (w: --eager-weight, 1 by default); where
    the mean lands inside the period (tau 1), it replaces that stand-in: x <- x + (A - start),
    and the period's start becomes A. Each pseudo-gradient is taken from its period's start.
    With ``bits`` 4 the mean is of the messages as decoded, each of Delta plus what the last
    one's rounding lost (error feedback), and each worker sends its message to the 2 others;
    fp32 sends a ring all-reduce's bytes."""
    ranks = RUNS.get("co2", *_co2_case(eager, bits, weight, tau))
    codec = Int4()
    n = ranks[0]["records"][0]["anchor"].numel()
    block, chunk = codec.layout(n, 1)
    residuals = [torch.zeros(n) for _ in ranks]
    momentum = torch.zeros_like(ranks[0]["records"][0]["anchor"])
    in_flight = None
    anchor = ranks[0]["records"][0]["anchor"].clone()
    starts = [anchor] * len(ranks)
    landed_inside = 0
    for i in range(7):
        step = i + 1
        recs = [r["records"][i] for r in ranks]
        assert all(torch.equal(rec["anchor"], recs[0]["anchor"]) for rec in recs)  # bitwise
        torch.testing.assert_close(recs[0]["anchor"], anchor, atol=1e-6, rtol=1e-6)
        anchor = recs[0]["anchor"]
        if step % 2:
            if tau == 1 and in_flight is not None:  # the mean lands inside the period
                momentum = (momentum * 0.5 + in_flight / 2).clamp(-1, 1)
                anchor = anchor - 0.8 * momentum
                for rec, start in zip(recs, starts, strict=True):
                    torch.testing.assert_close(
                        rec["after"], rec["local"] + (anchor - start), atol=1e-6, rtol=1e-6
                    )
                starts, in_flight = [anchor] * len(ranks), None
                landed_inside += 1
            else:
                assert all(torch.equal(rec["after"], rec["local"]) for rec in recs)  # no sync
            continue
        deltas = [start - rec["local"] for start, rec in zip(starts, recs, strict=True)]
        if in_flight is not None:
            momentum = (momentum * 0.5 + in_flight / 2).clamp(-1, 1)
            anchor = anchor - 0.8 * momentum
        sent = deltas
        if bits == 4:
            sent = [codec.roundtrip(d + r) for d, r in zip(deltas, residuals, strict=True)]
            residuals = [d + r - q for d, r, q in zip(deltas, residuals, sent, strict=True)]
            assert all(rec["sent"] == 2 * codec.row_bytes(chunk, block) for rec in recs)
        else:
            assert all(rec["sent"] == 2 * 2 * 4 * (n + 1) // 3 for rec in recs)  # the weight travels too
        in_flight = torch.stack(sent).mean(dim=0)
        starts = [anchor - 0.4 * weight * d if eager else anchor for d in deltas]
        for rec, start in zip(recs, starts, strict=True):
            torch.testing.assert_close(rec["after"], start, atol=1e-6, rtol=1e-6)
        if not eager:
            assert all(torch.equal(rec["after"], recs[0]["after"]) for rec in recs)
    assert landed_inside == (3 if tau == 1 else 0)  # after steps 3, 5 and 7
    # finalize after step 7 (inside a period): this period's pseudo-gradient from where each
    # worker started it (with bits, plus what the last message's rounding lost), then the
    # landing of step 6's message (tau 2; tau 1 landed it at step 7), then one outer step.
    last = [r["records"][6] for r in ranks]
    finals = [
        s - rec["after"] + (r if bits == 4 else 0) for s, rec, r in zip(starts, last, residuals, strict=True)
    ]
    final_delta = torch.stack(finals).mean(dim=0)
    for mean in (in_flight, final_delta):
        if mean is not None:
            momentum = (momentum * 0.5 + mean / 2).clamp(-1, 1)
            anchor = anchor - 0.8 * momentum
    for r in ranks:
        assert torch.equal(r["final"], ranks[0]["final"])
        torch.testing.assert_close(r["final"], anchor, atol=1e-6, rtol=1e-6)


def _co2_case(eager: bool, bits: int, weight: float, tau: int) -> tuple:
    """RUNS' arguments for a co2 case: its defaults left out, as the case list spells them."""
    if tau != 2:
        return (eager, bits, weight, tau)
    if weight != 1:
        return (eager, bits, weight)
    return (eager, bits) if bits != 32 else (eager,)


def test_quantized_messages_with_error_feedback_lose_nothing_over_time():
    """What every message's rounding lost is sent with the next: over any run of messages the
    decoded ones sum to the inputs' sum less the last residual (bitwise up to fp32 sums), and a
    message is 1/8 of fp32 plus a scale per 256 values (int4) or 1/4 plus them (int8)."""
    from geotrain.sync.quantized_gather import QuantizedGather

    for bits, factor in ((4, 2), (8, 1)):
        messages = QuantizedGather(Communicator(), bits)
        assert messages.payload_bytes(1000) == 1024 // factor + 4 * 4
        gen = torch.Generator().manual_seed(bits)
        residual, sent, total = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
        for _ in range(6):
            delta = torch.randn(1000, generator=gen)
            total += delta
            message, residual = messages.encode_with_feedback(delta, residual)
            sent += messages.mean(message.unsqueeze(0), 1000)[0]
        torch.testing.assert_close(sent + residual, total, atol=1e-5, rtol=0)
        assert residual.abs().max() < 0.5 and residual.any()  # at most half a level, per block


def test_co2_error_feedback_stays_honest_under_chaos_and_restarts_where_its_message_is_left_out():
    """With --bits 4: a --chaos-spoiled message leaves the residual the honest message would
    have left; a message left out of the mean (or one not finite) drops what its rounding lost,
    which would otherwise be sent again at every later message."""
    _, opt, sync = _tiny("co2", {"H": 1, "bits": 4})
    _, honest_opt, honest = _tiny("co2", {"H": 1, "bits": 4})
    _train_step(sync, opt, 0, 1)
    _train_step(honest, honest_opt, 0, 1)
    assert torch.equal(sync._residual, honest._residual) and sync._residual.any()
    sync.comm.corrupt_next = "signflip"
    _train_step(sync, opt, 0, 2)
    _train_step(honest, honest_opt, 0, 2)
    assert not sync.comm.corrupt_next  # spent on this message
    assert not torch.equal(sync.in_flight.saved(), honest.in_flight.saved())
    assert torch.equal(sync._residual, honest._residual) and sync._residual.any()
    # the message in flight left out of the mean (as the norm check leaves one out)
    real_mean = sync.messages.mean

    def left_out(gathered: torch.Tensor, n: int) -> tuple[torch.Tensor, list[bool]]:
        return real_mean(gathered, n)[0], [False]

    sync.messages.mean = left_out
    sync._land_in_flight()
    assert not sync._residual.any()
    honest._land_in_flight()
    assert honest._residual.any()  # kept where its message was taken
    # a pseudo-gradient that is not finite: nothing of it is kept for the next message
    _, residual = sync.messages.encode_with_feedback(torch.full((300,), float("nan")), torch.ones(300))
    assert not residual.any()
    sync.close()
    honest.close()


def test_the_eager_weight_reaches_co2_from_the_command_line_config():
    from geotrain.train import TrainConfig

    assert TrainConfig(algo="co2").sync_config().eager_weight == 1.0
    assert TrainConfig(algo="co2", eager_weight=0.0).sync_config().eager_weight == 0.0
    assert TrainConfig(algo="co2", eager_weight=0.5).to_argv()[-2:] != ["--eager-weight", "-1.0"]
    assert "--eager-weight" in TrainConfig(algo="co2", eager_weight=0.5).to_argv()


def test_a_mean_in_flight_is_over_the_workers_that_sent_one():
    """InFlight's mean carries a weight: an adopter's empty message (a joiner's) weighs nothing,
    where a zero message would pull the mean toward zero."""
    flight = InFlight(Communicator(), op="mean")
    flight.launch(torch.tensor([2.0, -4.0]))
    assert torch.equal(flight.land(), torch.tensor([2.0, -4.0]))
    flight.launch(torch.tensor([2.0, -4.0]))
    flight.rebind()
    assert torch.equal(flight.saved(), torch.tensor([2.0, -4.0, 1.0]))  # the weight travels too
    flight.adopted()
    assert torch.equal(flight.land(), torch.zeros(2))  # weight 0: nothing, and no division by 0


@pytest.mark.parametrize("eager", [True, False])
def test_a_co2_launch_whose_screen_fails_is_made_again_by_the_retry_and_lands_once(eager):
    """CO2's mean is screened (--max-norm-ratio, a robust aggregate) by a collective before it is
    launched. Where that fails after the last period's mean landed, the retry (``rebind``,
    ``retry_sync``) makes the message again and lands nothing: it ends where a run without the
    failure does, to the bit. Kept to send again, the new message would land as the last one's
    and then be launched again, the period's progress applied twice. A message sent again whose
    screen fails stays the one to land. Without eager the period's start is the anchor, which
    the landing moves: the retry still takes the delta the failed launch had. A worker that
    adopts the failed worker's state starts from the anchor, its own message being empty."""

    class Screened(Communicator):
        fail = False

        def all_reduce(self, tensor, op="mean", async_op=False, screen=False):
            if screen and self.fail:
                self.fail = False
                raise RuntimeError("a member was lost")
            return super().all_reduce(tensor, op=op, async_op=async_op, screen=screen)

    runs = []
    for fails in (False, True):
        comm = Screened()
        _, opt, sync = _tiny("co2", {"H": 2, "tau": 2, "bits": 32, "eager": eager}, comm)
        seen = []
        for step in range(1, 7):
            comm.fail = fails and step == 4
            if comm.fail:
                with pytest.raises(RuntimeError, match="lost"):
                    _train_step(sync, opt, 0, step)
                assert sync.in_flight.landings == 1 and not sync.in_flight.flying  # landed, then failed
                _, _, adopter = _tiny("co2", {"H": 2, "tau": 2, "bits": 32, "eager": eager}, seed=1)
                adopter.load_state_dict(sync.state_dict())
                adopter.adopted_state()
                # its own message is empty: its period starts from the anchor, as do its parameters
                assert torch.equal(adopter._start, sync._anchor) and not adopter.in_flight.flying
                assert torch.equal(adopter._local(), sync._anchor)
                adopter.close()
                sync.rebind()
                sync.retry_sync()
            else:
                _train_step(sync, opt, 0, step)
            seen.append((sync._anchor.clone(), sync._local(), sync.in_flight.landings))
        runs.append(seen)
        sync.close()
    for (a, x, n), (b, y, m) in zip(*runs, strict=True):
        assert torch.equal(a, b) and torch.equal(x, y) and n == m
    flight = InFlight(Screened(), op="mean")
    flight.launch(torch.tensor([2.0, -4.0]))
    flight.rebind()
    flight.comm.fail = True
    with pytest.raises(RuntimeError, match="lost"):
        flight.land()
    assert torch.equal(flight.saved(), torch.tensor([2.0, -4.0, 1.0])) and flight.landings == 0
    assert torch.equal(flight.land(), torch.tensor([2.0, -4.0])) and flight.landings == 1


def test_an_adopter_of_a_finished_streaming_worker_has_its_final_model_and_a_co2_one_its_anchor():
    """Streaming DiLoCo's end-of-run average leaves each fragment's global value at the final
    one, so a worker whose own average failed and that adopts a finished one's state (which
    rebuilds its parameters from the fragments) ends on that model; a worker that adopts one
    inside the average goes on from its stage. CO2's period start is the worker's own part:
    never handed over, and an adopter (4-bit messages in flight) starts from the anchor."""
    _, opt, done = _tiny("streaming", {"H": 8, "fragments": 2, "tau": 1})
    for step in range(1, 12):
        _train_step(done, opt, 0, step)
    done.finalize()
    model = flatten(list(done.parameters()))
    assert torch.equal(torch.cat(done.shared_state()), flatten([p for f in done.fragments for p in f]))
    state = done.state_dict()
    assert state["final_stage"] == 2
    adopter_model, _, adopter = _tiny("streaming", {"H": 8, "fragments": 2, "tau": 1}, seed=1)
    adopter.load_state_dict(state)
    adopter.adopted_state()
    assert torch.equal(flatten(list(adopter.parameters())), model) and adopter._final_stage == 2
    for s in (done, adopter):
        s.close()

    _, opt, co2 = _tiny("co2", {"H": 4, "tau": 2})
    for step in range(1, 6):
        _train_step(co2, opt, 0, step)
    state = co2.state_dict()
    assert "start" not in state and "start" in state["own"] and co2.in_flight.flying
    handed = {k: v for k, v in state.items() if k != "own"}
    _, _, other = _tiny("co2", {"H": 4, "tau": 2}, seed=1)
    other.load_state_dict(handed)
    other.adopted_state()
    assert torch.equal(other._start, co2._anchor) and torch.equal(other._local(), co2._anchor)
    resumed = _tiny("co2", {"H": 4, "tau": 2}, seed=1)[2]
    resumed.load_state_dict(state)
    assert torch.equal(resumed._start, co2._start)
    for s in (co2, other, resumed):
        s.close()


# -- the CLI --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--algo", "diloco", "--tau", "2"], "diloco does not take --tau"),
        (["--algo", "co2", "--tau", "0"], "must be auto or in [1, H] = [1, 10], got 0"),
        (["--algo", "streaming", "--tau", "soon"], "takes a number of steps >= 0 or auto"),
        (["--algo", "streaming", "--H", "10"], "must be a multiple of --fragments 4"),
        (["--algo", "co2", "--gap-penalty", "0.5"], "--gap-penalty"),
        (["--algo", "co2", "--eager-weight", "half"], "--eager-weight: invalid float value: 'half'"),
        (["--algo", "co2", "--eager-weight", "3"], "--eager-weight must be a number in [0, 2], got 3.0"),
        (["--algo", "diloco", "--eager-weight", "0"], "diloco does not take --eager-weight"),
        (["--algo", "streaming", "--eager-weight", "0.5"], "streaming does not take --eager-weight"),
    ],
)
def test_the_cli_refuses_bad_streaming_and_co2_options_in_one_line(args, needle):
    assert needle in refused(["run", "--workers", "2", "--no-netem", *args])


def _probed(rank: int, algo: str, options: dict, exchanges: list[float] | None):
    """``algo`` with ``options`` (tau auto) after its start-up probe, each worker's exchange as
    ``exchanges`` says, with 1 s steps (None: the real ones, timed on this loopback group): the
    model, optimizer, algorithm, the loss it probed with, its tau and option before, and what the
    probe left (tau, option, gradients left behind, bytes sent, control calls)."""
    if exchanges is not None:
        cls = streaming_module.StreamingDiLoCo if algo == "streaming" else co2_module.CO2
        cls._time_exchange = lambda self: exchanges[self.comm.rank]
        profile_module.profile_compute = lambda *a, **k: {"step_s": 1.0, "barrier_wait_s": 0.0}
    comm = Communicator()
    model, opt, sync = _tiny(algo, options, comm)
    before = (sync.config.tau, sync.resolved_options()["tau"])
    sent, control = comm.stats.sent_bytes, comm.control_calls

    def loss():
        x, y = _batch(rank + 10, 0)
        return sync.model(x, y)[1]

    sync.prepare(loss)
    after = {"tau": sync.config.tau, "option": sync.resolved_options()["tau"]}
    after |= {"grads": [p.grad for p in model.parameters() if p.grad is not None]}
    after |= {"sent": comm.stats.sent_bytes - sent, "control": comm.control_calls - control}
    return model, opt, sync, loss, before, after


def _restored(sync, algo: str, options: dict, loss):
    """A worker restored from ``sync``'s state (through bytes, as a snapshot or a hand-over
    carries it), its own probe run: a restored choice measures nothing again."""
    import io

    saved = io.BytesIO()
    torch.save(sync.state_dict(), saved)
    _, _, again = _tiny(algo, options, Communicator(), seed=1)
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    profile_module.profile_compute = None
    again.prepare(loss)
    return again


def _tau_auto(rank, world_size, gathers: list[float] | None):
    """--tau auto on a real group: each worker's gather as ``gathers`` says (``_probed``); the
    tau taken, the steps it launches and lands at, and a worker restored from the state saved
    after them."""
    options = {"H": 20, "fragments": 4, "tau": "auto"}
    model, opt, sync, loss, before, after = _probed(rank, "streaming", options, gathers)
    after["period"] = sync.sync_period()
    launched, landed = [], []
    for step in range(1, 12):
        flying = sync.in_flight.flying
        _train_step(sync, opt, rank, step)
        launched += [step] if sync.in_flight.flying and not flying else []
        landed += [step] if sync._landing(step) is not None else []
    again = _restored(sync, "streaming", options, loss)
    restored = {"tau": again.config.tau, "option": again.resolved_options()["tau"]}
    restored |= {"flying": again.in_flight.flying, "fragment": again._in_flight_fragment()}
    sync.close()
    again.close()
    return {"before": before, "after": after, "launched": launched, "landed": landed, "restored": restored}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("gathers, chosen", [([0.0, 0.0], 1), ([0.0, 2.0], 3), ([1e6, 0.0], 4), (None, None)])
def test_tau_auto_measures_at_start_up_the_slowest_decides_and_a_restore_keeps_it(gathers, chosen):
    """Two workers: ``prepare`` times steps and a gather (given, with 1 s steps: none, 2 s on
    one worker, which the slowest-decides agreement makes both workers', or 1e6 s, capped one
    step before the next fragment's launch; or the real ones, whose bytes stay out of the run's),
    and both launch each fragment tau steps before it lands (steps 5, 10 at H=20 in 4 fragments),
    the summary's option saying so, no gradient left behind. A state saved with a fragment in
    flight carries tau, and a worker restored from it (a resume, a joiner) measures nothing and
    has the same fragment in flight."""
    out = run_workers(_tau_auto, 2, gathers, timeout=210)
    if gathers is None:
        chosen = out[0]["after"]["tau"]
        assert 1 <= chosen <= 4
    for r in out:
        assert r["before"] == (1, "auto (not measured: 1)")
        a = r["after"]
        assert (a["tau"], a["option"]) == (chosen, f"auto (measured: {chosen})")
        assert a["period"] == math.gcd(5, chosen) and not a["grads"]
        if gathers is None:  # the profile's barriers, the probe's two gathers and its barrier
            assert a["sent"] == 0 and a["control"] >= 7
        in_flight = 15 - chosen <= 11  # fragment 2, launched at step 15 - tau
        assert r["launched"] == [5 - chosen, 10 - chosen] + ([15 - chosen] if in_flight else [])
        assert r["landed"] == [5, 10]
        assert r["restored"]["tau"] == chosen and r["restored"]["option"] == f"auto (restored: {chosen})"
        assert r["restored"]["flying"] is in_flight
        if in_flight:
            assert r["restored"]["fragment"] == 2


def test_tau_auto_alone_measures_nothing_and_takes_the_members_tau(monkeypatch):
    """A world of one (a joiner before it is admitted): no probe, tau 1; the members' state
    handed over sets theirs, also a state saved before --tau auto existed (its config's tau)."""
    monkeypatch.setattr(profile_module, "profile_compute", lambda *a, **k: pytest.fail("measured"))
    _, _, sync = _tiny("streaming", {"tau": "auto"})
    sync.prepare(lambda: pytest.fail("a step taken"))
    assert sync.config.tau == 1 and sync.resolved_options()["tau"] == "auto (alone: 1)"
    _, _, members = _tiny("streaming", {"tau": 3})
    sync.load_state_dict(members.state_dict())
    assert sync.config.tau == 3 and sync.sync_period() == 1
    assert sync.resolved_options()["tau"] == "auto (restored: 3)"
    _, _, two = _tiny("streaming", {"tau": 2})
    older = two.state_dict()
    del older["tau"]
    sync.load_state_dict(older)
    assert sync.config.tau == 2
    _, _, fixed = _tiny("streaming", {"tau": 2})  # a tau given is kept whatever the state says
    fixed.load_state_dict(members.state_dict())
    assert fixed.config.tau == 2 and fixed.resolved_options() == {}
    for s in (sync, members, two, fixed):
        s.close()


def _co2_tau_auto(rank, world_size, exchanges: list[float] | None, bits: int):
    """co2 --tau auto on a real group (H 4): each worker's exchange as ``exchanges`` says
    (``_probed``); the tau taken, the steps its means land at inside a period, and a worker
    restored from the state saved with a mean in flight."""
    options = {"H": 4, "tau": "auto", "bits": bits}
    model, opt, sync, loss, before, after = _probed(rank, "co2", options, exchanges)
    after |= {"period": sync.collective_period(), "info": sync.info()}
    landed = []
    for step in range(1, 10):
        flying = sync.in_flight.flying
        _train_step(sync, opt, rank, step)
        landed += [step] if flying and not sync.in_flight.flying else []
    again = _restored(sync, "co2", options, loss)  # after step 9: step 8's mean in flight unless tau 1
    restored = {"tau": again.config.tau, "option": again.resolved_options()["tau"]}
    restored |= {"flying": again.in_flight.flying, "start": torch.equal(again._start, sync._start)}
    sync.close()
    again.close()
    return {"before": before, "after": after, "landed": landed, "restored": restored}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "exchanges, bits, chosen",
    [([0.0, 0.0], 4, 1), ([0.0, 1.5], 4, 3), ([1e6, 0.0], 4, 4), (None, 4, None), (None, 32, None)],
)
def test_co2_tau_auto_lands_each_mean_as_soon_as_the_measured_exchange_is_hidden(exchanges, bits, chosen):
    """Two workers, H 4: ``prepare`` times steps and an exchange (given, with 1 s steps: none,
    1.5 s on one worker, which the slowest-decides agreement makes both workers', or 1e6 s,
    capped at a period late; or the real gather, or the fp32 all-reduce, whose bytes stay out of
    the run's), and each period's mean (sent at steps 4 and 8) lands tau steps later: inside the
    next period where tau < 4, at the next outer step (never emptying the flight) at tau 4. The
    summary's option and the run's info say so. A state saved with a mean in flight carries tau,
    and a worker restored from it measures nothing and has the same start and flight."""
    out = run_workers(_co2_tau_auto, 2, exchanges, bits, timeout=210)
    if exchanges is None:
        chosen = out[0]["after"]["tau"]
        assert 1 <= chosen <= 4
    for r in out:
        assert r["before"] == (4, "auto (not measured: 4)")
        a = r["after"]
        assert (a["tau"], a["option"]) == (chosen, f"auto (measured: {chosen})")
        assert a["period"] == 4 and not a["grads"]  # (a landing inside it: places_by_message)
        steps = "1 step" if chosen == 1 else f"{chosen} steps"
        late = "one period late" if chosen == 4 else f"landing {steps} into the next period"
        assert a["info"].endswith(late)
        if exchanges is None:  # the profile's barriers, the probe's exchanges and its barrier
            assert a["sent"] == 0 and a["control"] >= 7
        assert r["landed"] == (
            [] if chosen == 4 else [4 + chosen] + ([8 + chosen] if 8 + chosen <= 9 else [])
        )
        flying = chosen > 1  # step 8's mean, landing at 8 + tau > 9
        assert r["restored"] == {
            "tau": chosen,
            "option": f"auto (restored: {chosen})",
            "flying": flying,
            "start": True,
        }


def test_a_co2_result_from_an_older_group_is_read_by_the_row_each_worker_sent_there():
    """A 4-bit mean kept at a regroup (or handed over with the state: ``in_flight_result``) has
    the rows of the group it was sent in. A joiner ranked after them (rank 2 of a result of 2
    rows) sent none of them: it lands the mean, its residual untouched (it used to read row 2:
    IndexError, the joiner's process gone). A member reads its own row, wherever its rank now
    is: left out there, what its rounding lost goes too; another's row left out leaves its
    residual alone."""
    _, opt, member = _tiny("co2", {"H": 4, "tau": 2})
    for step in range(1, 5):  # step 4 launches this worker's message
        _train_step(member, opt, 0, step)
    message = member.in_flight.saved()
    state = member.state_dict()
    kept = torch.stack([message, torch.zeros_like(message)])  # row 1: an empty message
    state["in_flight_result"] = kept
    joining = Communicator()
    joining.rank = 2
    _, _, joiner = _tiny("co2", {"H": 4, "tau": 2}, comm=joining)
    joiner.load_state_dict(state)
    joiner.adopted_state()
    joiner._residual.fill_(0.25)  # (zero after adopting: made visible)
    anchor = joiner._anchor.clone()
    joiner._land_in_flight()  # lands the kept result, nothing sent
    assert not torch.equal(joiner._anchor, anchor) and torch.all(joiner._residual == 0.25)
    for sent_as, zeroed in (((1, 2), True), ((0, 2), False)):
        _, _, again = _tiny("co2", {"H": 4, "tau": 2})
        again.load_state_dict(state)
        again.in_flight.sent_as = sent_as  # launched at that rank in a group of 2
        again._residual.fill_(0.25)
        again._land_in_flight()
        assert bool(torch.all(again._residual == 0.0)) is zeroed, sent_as
        again.close()
    for s in (member, joiner):
        s.close()


def test_co2_tau_auto_alone_measures_nothing_and_takes_the_members_tau(monkeypatch):
    """A world of one (a joiner before it is admitted): no probe, a period late; the members'
    state handed over sets theirs, and a state saved before co2 had a tau lands a period late."""
    monkeypatch.setattr(profile_module, "profile_compute", lambda *a, **k: pytest.fail("measured"))
    _, _, sync = _tiny("co2", {"H": 4})
    sync.prepare(lambda: pytest.fail("a step taken"))
    assert sync.config.tau == 4 and sync.resolved_options()["tau"] == "auto (alone: 4)"
    _, _, members = _tiny("co2", {"H": 4, "tau": 2})  # given: a run resumed under auto keeps it
    state = members.state_dict()
    sync.load_state_dict(state)
    assert sync.config.tau == 2 and sync.collective_period() == 4
    assert sync.resolved_options()["tau"] == "auto (restored: 2)"
    del state["tau"]  # a state saved before the tau was: its config's
    sync.load_state_dict(state)
    assert sync.config.tau == 2
    state["config"] = {k: v for k, v in state["config"].items() if k not in ("tau", "tau_auto")}
    sync.load_state_dict(state)  # before co2 had a tau: a period late
    assert sync.config.tau == 4 and sync.collective_period() == 4
    _, _, one = _tiny("co2", {"H": 1})
    one.prepare(lambda: pytest.fail("a step taken"))  # H 1: the next step is the next period
    assert one.config.tau == 1 and one.resolved_options()["tau"] == "auto (H is 1: 1)"
    one.close()
    _, _, fixed = _tiny("co2", {"H": 4, "tau": 1})  # a tau given is kept whatever the state says
    fixed.load_state_dict({**state, "tau": 3})
    assert fixed.config.tau == 1 and fixed.resolved_options() == {}
    for s in (sync, members, fixed):
        s.close()


@pytest.mark.parametrize("bits", [4, 32])
def test_co2_times_at_most_a_mib_of_its_exchange_and_scales_it_by_the_bytes(monkeypatch, bits):
    """The start-up probe's exchange is of at most PROBE_BYTES, its seconds scaled by the
    message's bytes: the whole model's would hold the start as long as an outer step's."""
    timed = []
    monkeypatch.setattr(co2_module, "PROBE_BYTES", 1000)
    monkeypatch.setattr(co2_module, "time_gather", lambda comm, nbytes, device: timed.append(nbytes) or 0.5)
    monkeypatch.setattr(
        co2_module, "time_all_reduce", lambda comm, numel, device: timed.append(4 * numel) or 0.5
    )
    _, _, sync = _tiny("co2", {"bits": bits})
    n = sync._anchor.numel()
    nbytes = sync.messages.payload_bytes(n) if bits == 4 else 4 * (n + 1)
    assert sync._time_exchange() == pytest.approx(0.5 * nbytes / 1000)
    assert timed == [1000]
    sync.close()
