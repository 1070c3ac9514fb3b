"""geotrain bench: time to target, the network model, the report, and the command end to end."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from geotrain.bench.curves import (
    Curve,
    agreement,
    compose,
    crossing,
    final_loss,
    smooth,
    step_times,
    time_to_target,
    tokens_to_target,
)
from geotrain.bench.matrix import Bench, BenchConfig, compute_share
from geotrain.bench.report import markdown_table, write_report
from geotrain.plan.cost import LinkModel
from geotrain.plan.network import NetworkModel
from geotrain.sync import ConfigError
from geotrain.train import TrainConfig
from helpers import geotrain


def test_time_to_target_interpolates_the_first_crossing():
    curve = Curve(
        train_s=[10.0, 20.0, 30.0, 40.0], tokens=[100, 200, 300, 400], val_loss=[3.0, 2.5, 2.0, 2.2]
    )
    assert time_to_target(curve, 2.5) == pytest.approx(20.0)
    assert time_to_target(curve, 2.25) == pytest.approx(25.0)  # halfway between 2.5 and 2.0
    assert tokens_to_target(curve, 2.25) == pytest.approx(250.0)
    assert time_to_target(curve, 3.5) == pytest.approx(10.0)  # already below at the first point
    assert time_to_target(curve, 2.1) == pytest.approx(28.0)  # the first crossing, not the later rise


def test_a_curve_that_never_reaches_the_target_has_no_time():
    curve = Curve(train_s=[1.0, 2.0], tokens=[1, 2], val_loss=[3.0, 2.9])
    assert time_to_target(curve, 2.0) is None
    assert crossing([], [], 1.0) is None


def test_smoothing_keeps_one_noisy_evaluation_from_deciding_the_crossing():
    """A curve that dips below the target once and comes back: the raw curve says it got there at
    the dip; the centred mean over 3 evaluations says where it gets there for good."""
    losses = [3.0, 2.6, 2.35, 2.6, 2.5, 2.4, 2.3, 2.2]
    curve = Curve(train_s=[10.0 * (i + 1) for i in range(8)], tokens=list(range(8)), val_loss=losses)
    assert smooth(losses, 3) == pytest.approx([2.8, 2.65, 2.5167, 2.4833, 2.5, 2.4, 2.3, 2.25], abs=1e-4)
    assert smooth(losses, 1) == losses
    assert time_to_target(curve, 2.4) == pytest.approx(30.0 - 10 * 0.05 / 0.25)  # the dip: 28 s
    # 2.5 at 50 s, 2.4 at 60 s: the smoothed curve crosses 2.4 at 60 s, after the dip has passed
    assert time_to_target(curve, 2.4, window=3) == pytest.approx(60.0)
    assert tokens_to_target(curve, 2.45, window=3) == pytest.approx(4.5)
    assert final_loss(curve, 3) == pytest.approx(2.25)  # the mean of the last two
    assert final_loss(Curve([], [], [])) is None
    for bad in (0, 2, -1):
        with pytest.raises(ValueError, match="odd number >= 1"):
            smooth(losses, bad)


def test_a_composed_curve_puts_each_step_at_the_shaped_step_time_and_is_checked_against_a_real_run():
    long = Curve([5.0, 9.0, 14.0, 18.0], [100, 200, 300, 400], [3.0, 2.6, 2.4, 2.3], [10, 20, 30, 40])
    # the shaped run: 0.4 s a local step, 1.4 s a step that syncs (its first step not counted)
    shaped = [{"step_s": 9.0, "synced": False}] + [{"step_s": 0.4, "synced": False}] * 9
    shaped += [{"step_s": 1.4, "synced": True}] * 2 + [{"step_s": 5.0, "synced": True, "final": True}]
    timing = step_times(shaped)
    assert timing == pytest.approx({True: 1.4, False: 0.4})
    every_tenth = [s % 10 == 0 for s in range(1, 41)]  # the long run synced at 10, 20, 30, 40
    composed = compose(long, every_tenth, timing)
    assert composed.train_s == pytest.approx([5.0, 10.0, 15.0, 20.0]) and composed.val_loss == long.val_loss
    assert time_to_target(composed, 2.5) == pytest.approx(12.5)
    assert step_times([{"step_s": 2.0, "synced": True}] * 3) == {True: 2.0, False: 2.0}  # one kind
    # the shaped run: 30 steps, its last point the end-of-run average (not compared)
    real = Curve([5.5, 10.5, 15.2], [100, 200, 300], [3.0, 2.65, 2.2], [10, 20, 30])
    assert agreement(composed, real) == pytest.approx(
        {"steps_compared": 20, "max_loss_diff": 0.05, "time_ratio": 10.0 / 10.5}
    )
    assert agreement(composed, Curve([1.0], [1], [3.0], [7])) is None
    with pytest.raises(ValueError, match="needs the step of each point"):
        compose(Curve([1.0], [1], [3.0]), [True], timing)
    with pytest.raises(ValueError, match="must be > 0"):
        compose(long, every_tenth, {True: 1.0, False: 0.0})
    with pytest.raises(ValueError, match="has 30 steps timed, its curve goes to 40"):
        compose(long, every_tenth[:30], timing)


def test_network_model_calibrates_back_to_the_profile_and_scales():
    link = LinkModel(alpha_s=6e-3, beta_s_per_byte=1.2e-7)  # measured on 4 workers at 100 Mbit/s
    net = NetworkModel.calibrate(link, 4, [10**8] * 4)
    same = net.link_model(4, [10**8] * 4, "ring")
    assert same.alpha_s == pytest.approx(link.alpha_s) and same.beta_s_per_byte == pytest.approx(
        link.beta_s_per_byte
    )
    # 10x the bandwidth: 10x less per byte; ring latency grows with N, tree latency with log N
    fast = net.link_model(4, [10**9] * 4, "ring")
    assert fast.beta_s_per_byte == pytest.approx(link.beta_s_per_byte / 10)
    big_ring = net.link_model(1024, [10**9] * 1024, "ring")
    big_tree = net.link_model(1024, [10**9] * 1024, "tree")
    assert big_ring.alpha_s == pytest.approx(2 * 1023 * 1e-3)
    assert big_tree.alpha_s == pytest.approx(2 * 10 * 1e-3)
    assert net.link_model(1024, [10**9] * 1024, "best") == big_tree  # latency dominates at 1 MB
    # the slowest host sets the pace
    uneven = net.link_model(4, [10**8, 10**8, 10**8, 2 * 10**7], "ring")
    assert uneven.beta_s_per_byte == pytest.approx(link.beta_s_per_byte * 5)


def test_compute_share_on_two_cores():
    assert [compute_share(w, cores=2) for w in (1, 2, 4, 8)] == [1, 1, 2, 4]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"algos": ["warp"]}, "unknown algorithm 'warp'"),
        ({"workers": [0]}, "1 to 64"),
        ({"bandwidths": ["fast"]}, "not understood"),
        ({"eval_every": 0}, "--eval-every"),
        ({"smooth": 2}, "--smooth must be an odd number"),
        ({"lr_schedule": "step"}, "unknown --lr-schedule 'step'; accepted: constant, cosine"),
        ({"model_config": "n_lyer=3"}, "--model-config n_lyer: tiny takes dropout, n_embd"),
        ({"lora": "r=0"}, "--lora"),
    ],
)
def test_bench_config_rejects_bad_matrices(kwargs, message):
    from geotrain.netem.links import LinkSpecError

    with pytest.raises((ConfigError, LinkSpecError), match=message):
        BenchConfig(**kwargs)


def _synthetic_results():
    def row(step, blocked, loss_end, ttt):
        curve = {"train_s": [step * 10, step * 20], "tokens": [1000, 2000], "val_loss": [3.0, loss_end]}
        return {
            "summary": {},
            "curve": curve,
            "step_s": step,
            "compute_s": step - (blocked or 0.1),
            "exposed_comm_s": blocked if blocked is not None else 0.1,
            "exposed_comm_measured": blocked is not None,
            "tokens_per_s": 1000 / step,
            "sent_bytes_per_step": 2e6,
            "final_val_loss": loss_end,
            "efficiency": 0.1 / step,
            "step_speedup_vs_ddp": 0.5 / step,
            "time_to_target_s": ttt,
            "time_speedup_vs_ddp": (10.0 / ttt) if ttt else None,
        }

    return {
        "config": {"model": "tiny", "steps": 20, "batch_size": 8, "H": 4, "seed": 0},
        "groups": [
            {
                "workers": 2,
                "bandwidth": "20mbit",
                "target_loss": 2.5,
                "network_mode": "netns",
                "algos": {
                    "nosync": row(0.1, 0.0, 2.6, None),
                    "ddp": row(0.5, None, 2.5, 10.0),
                    "localsgd": row(0.2, 0.1, 2.4, 3.5),
                },
            }
        ],
        "scale": [
            {
                "workers": 4,
                "bandwidth": "20mbit",
                "algo": "ddp",
                "predicted_s": 0.55,
                "measured_s": 0.5,
                "error": 0.1,
                "profiled_at": 2,
            }
        ],
    }


def test_report_from_results(tmp_path):
    results = _synthetic_results()
    # a cell predicted over the budget, and what the group's link stands for on an H100
    results["groups"][0]["skipped"] = {
        "ssgd": {"predicted_step_s": 19.0, "predicted_run_s": 1900.0, "budget_s": 300, "efficiency": 0.1 / 19}
    }
    results["groups"][0]["stands_for_bps"] = 1.63e9
    paths = write_report(results, tmp_path)
    for name in ("loss_vs_time", "loss_vs_tokens", "step_breakdown", "speedup_vs_ddp", "scale_check"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 5  # self-contained
    table = markdown_table(results)
    assert "| 2 | 20mbit | nosync | 0.100 |" in table and "not reached" in table
    assert "0.100*" in table  # ddp's exposed communication is inferred, and marked so
    assert "not reached" in page
    assert "| 2 | 20mbit | ssgd | ~19.000 (predicted) | not run | not run | ~0.01 | not run |" in table
    assert "outlast the cell budget (its whole run): ssgd on 2x20mbit (32 min)." in table
    assert "stands for on an H100" in table and "2x20mbit: 1.6 Gbit/s" in table


def test_a_cell_predicted_to_outlast_the_budget_is_not_run_and_is_reported_as_predicted(tmp_path):
    """2 workers at 350 kbit/s, a 600,000-parameter model computing 0.071 s a step: ddp's 2.4 MB
    all-reduce takes 55 s a step (92 min for 100 steps), so it is not run; nosync and sparseloco
    (its 16 KB gather hidden under 8 steps) are; ddp_powersgd, which the planner does not price,
    is run whatever its cost."""
    from geotrain.bench.matrix import Bench, group_dir

    algos = ["nosync", "ddp", "sparseloco", "ddp_powersgd", "ssgd"]
    cfg = BenchConfig(algos=algos, bandwidths=["350kbit"], workers=[2], steps=100, cell_budget_s=60)
    said = []
    bench = Bench(cfg, tmp_path, echo=said.append)
    group = group_dir(tmp_path, 2, "350kbit")
    group.mkdir(parents=True)
    profile = {
        "version": 1,
        "model": "tiny",
        "workers": 2,
        "link": "350kbit",
        "network_mode": "netns",
        "batch_size": 8,
        "layers": [{"name": f"l{i}", "bytes": 200_000, "backward_s": 0.004} for i in range(12)],
        "forward_s": 0.02,
        "optimizer_s": 0.003,
        "backward_total_s": 0.048,
        "allreduce": {"alpha_s": 0.001, "beta_s_per_byte": 8 / 350e3},
    }
    (group / "profile.json").write_text(json.dumps(profile))
    assert [bench.over_budget(2, "350kbit", a) for a in algos[:4]] == [False, True, False, False]
    skipped = json.loads((group / "ddp" / "skipped.json").read_text())
    step = bench.predict_step(2, "350kbit", "ddp")
    assert skipped == {"predicted_step_s": step, "predicted_run_s": 100 * step, "budget_s": 60}
    assert step == pytest.approx(0.071 + 0.001 + 2.4e6 * 8 / 350e3, rel=0.01)
    assert said == [
        f"not running ddp on 2x350kbit: predicted {step:.2f} s/step, 92 min for 100 steps, "
        "over --cell-budget 60 s"
    ]
    assert bench.predict_step(2, "350kbit", "sparseloco") == pytest.approx(0.071)
    assert not (group / "sparseloco").exists()
    # a codec is priced where the algorithm takes one: int4 sends about an eighth of fp32's bytes
    int4 = bench.predict_step(2, "350kbit", "ddp+int4")
    assert 0.071 + (step - 0.071) / 9 < int4 < 0.071 + (step - 0.071) / 6
    assert bench.predict_step(2, "350kbit", "sparseloco+int4") is None  # takes no codec
    # a profile taken on loopback (namespaces could not be made) predicts nothing: the cell runs
    profile["link"] = "loopback (unshaped)"
    (group / "profile.json").write_text(json.dumps(profile))
    said.clear()
    assert not bench.over_budget(2, "350kbit", "ssgd") and not (group / "ssgd").exists()
    assert said[0].startswith("no prediction for ssgd on 2x350kbit (the profile was taken on")
    for free in (replace(cfg, cell_budget_s=0), replace(cfg, netem=False)):  # run every cell
        assert not Bench(free, tmp_path, echo=said.append).over_budget(2, "350kbit", "ddp")
    with pytest.raises(ConfigError, match="--cell-budget must be >= 0"):
        replace(cfg, cell_budget_s=-1)


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.long  # 50 s: `pytest -m long` (the horizon test below runs the bench end to end in CI)
def test_quick_bench_end_to_end_and_resume(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "geotrain", "bench", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    for name in (
        "report.html",
        "loss_vs_time.png",
        "loss_vs_tokens.png",
        "step_breakdown.png",
        "speedup_vs_ddp.png",
    ):
        assert (out / name).stat().st_size > 1000
    # the numbers printed are the JSON's numbers
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 |")]
    group = results["groups"][0]
    assert len(table) == len(group["algos"]) == 4
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = group["algos"][cells[2]]
        assert float(cells[3]) == pytest.approx(row["step_s"], abs=5e-4)
        assert float(cells[8]) == pytest.approx(row["final_val_loss"], abs=5e-5)
        ttt = row["time_to_target_s"]
        assert cells[9] == ("not reached" if ttt is None else f"{ttt:.3f}")
        common = row["time_to_common_s"]
        assert cells[11] == ("not reached" if common is None else f"{common:.3f}")
        if cells[2] != "nosync":  # the common loss is one every real algorithm reaches
            assert common is not None and final_loss(Curve(**row["curve"]), 3) <= group["common_loss"]
    ddp = group["algos"]["ddp"]
    ddp_final = final_loss(Curve(**ddp["curve"]), 3)  # the mean of its last two evaluations
    assert ddp["time_to_target_s"] is not None and math.isclose(group["target_loss"], ddp_final)
    mtimes = {p: p.stat().st_mtime for p in out.glob("cells/*/*/summary.json")}
    assert len(mtimes) == 4
    # each finished cell's saved states are gone (--keep-states keeps them), its metrics stay
    assert not list(out.glob("cells/*/*/checkpoint.pt")) and not list(out.glob("cells/*/*/snapshots"))
    assert len(list(out.glob("cells/*/*/metrics/rank0.jsonl"))) == 4

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert re.search(r"resuming: 4 of 4 runs already finished", again.stderr)
    assert {p: p.stat().st_mtime for p in out.glob("cells/*/*/summary.json")} == mtimes

    # Its runs are kept only for the same job: another schedule would not compare with them.
    other = subprocess.run([*cmd, "--lr-schedule", "cosine"], capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "holds runs made with lr_schedule='constant'" in other.stderr


@pytest.mark.usefixtures("no_leftovers")
def test_a_bench_over_a_horizon_composes_long_loopback_curves_with_shaped_step_times(tmp_path):
    """One run of 30 steps on loopback per algorithm gives each curve; the shaped runs of 20
    steps follow the first part of its cosine schedule, and check it step for step."""
    out = tmp_path / "bench"
    cmd = ["bench", "--workers", "2", "--bandwidths", "100mbit"]
    cmd += ["--algos", "localsgd", "--steps", "20", "--eval-every", "10", "--batch-size", "16"]
    cmd += ["--lr-schedule", "cosine", "--horizon", "30", "--cell-budget", "0", "--out", str(out)]
    proc = geotrain(cmd, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(out.glob("curves/2x30steps/*/summary.json"))) == 1
    # every finished run's saved states are gone (--keep-states keeps them), its metrics stay
    assert not list(out.rglob("checkpoint.pt")) and not list(out.rglob("snapshots"))
    assert list(out.glob("curves/2x30steps/*/metrics/rank0.jsonl"))
    group = json.loads((out / "bench.json").read_text())["groups"][0]
    assert group["composed"] == 30
    for algo, row in group["algos"].items():
        assert row["horizon_summary"]["lr_schedule"].endswith("over=30")
        assert row["curve"]["steps"] == [10, 20, 30]
        # same seeds, batches and schedule: the loopback run's steps are the shaped run's (up to
        # 10: the shaped run's point at 20 is its end-of-run model; at 10 a schedule over 20
        # steps would differ from one over 30)
        check = row["agreement"]
        assert check["steps_compared"] == 10 and check["max_loss_diff"] == 0.0, (algo, check)
        assert 0.7 < check["time_ratio"] < 1.3, (algo, check)
    assert "Composed curves" in proc.stdout


def test_every_cell_trains_the_model_the_bench_was_given():
    cfg = BenchConfig(algos=["nosync", "diloco"], model_config="n_layer=1", lora="r=2,alpha=4,targets=c_attn")
    for algo in ("nosync", "diloco"):
        job = cfg.train_config(algo)
        assert (job.model_config, job.lora, job.lora_fa) == ("n_layer=1", "r=2,alpha=4,targets=c_attn", False)


def test_a_rerun_with_another_warm_up_is_refused_even_where_a_horizon_changes_it(tmp_path):
    """A bench made before --warmup auto (no key) ran its cells without one; auto's steps follow
    the horizon, so a horizon added to an auto bench changes them too."""
    from dataclasses import asdict

    from geotrain.bench.matrix import Bench

    old = asdict(BenchConfig(algos=["nosync"], steps=150))
    del old["warmup"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="holds runs made with 0 warm-up steps, not 15; .* --warmup 0"):
        Bench(BenchConfig(algos=["nosync"], steps=150), tmp_path, echo=print).check_reuse()
    Bench(BenchConfig(algos=["nosync"], steps=150, warmup=0), tmp_path, echo=print).check_reuse()
    (tmp_path / "config.json").write_text(json.dumps(asdict(BenchConfig(algos=["nosync"], steps=150))))
    Bench(BenchConfig(algos=["nosync"], steps=150, warmup=15), tmp_path, echo=print).check_reuse()
    with pytest.raises(ConfigError, match="holds runs made with 15 warm-up steps, not 100"):
        Bench(BenchConfig(algos=["nosync"], steps=150, horizon=1000), tmp_path, echo=print).check_reuse()
    assert BenchConfig(algos=["nosync"], steps=150, horizon=1000).train_config("nosync").warmup == 100
    assert BenchConfig(algos=["demo"], steps=150).train_config("demo").warmup == 0


def test_a_rerun_with_another_model_is_refused_even_by_a_bench_that_did_not_record_it(tmp_path):
    """An older bench.json has no model_config or lora: it was made with their defaults then."""
    from dataclasses import asdict

    from geotrain.bench.matrix import Bench

    old = asdict(BenchConfig(algos=["nosync"]))
    for key in ("model_config", "lora", "lora_fa", "data", "tokenizer"):
        del old[key]
    (tmp_path / "config.json").write_text(json.dumps(old))
    Bench(BenchConfig(algos=["nosync"]), tmp_path, echo=print).check_reuse()  # the same job: kept
    with pytest.raises(ConfigError, match="holds runs made with lora=''"):
        Bench(
            BenchConfig(algos=["nosync"], lora="r=2,alpha=4,targets=c_attn"), tmp_path, echo=print
        ).check_reuse()


def test_a_rerun_of_a_bench_whose_dreamddp_ran_at_another_lr_scale_is_refused(tmp_path):
    """A bench made while dreamddp's local steps defaulted to --lr-scale auto (one stop) ran them
    at auto, one made before (no lr_scales key) at 1 as now; its other algorithms' cells still
    compare."""
    from dataclasses import asdict

    from geotrain.bench.matrix import Bench

    old = asdict(BenchConfig(algos=["nosync", "dreamddp"]))
    (tmp_path / "config.json").write_text(json.dumps(old))
    Bench(BenchConfig(algos=["nosync", "dreamddp"]), tmp_path, echo=print).check_reuse()  # at 1
    was_auto = {**old, "lr_scales": {"nosync": "1", "dreamddp": "auto"}}
    (tmp_path / "config.json").write_text(json.dumps(was_auto))
    with pytest.raises(
        ConfigError, match="holds dreamddp runs made at --lr-scale auto, where its default now is 1"
    ):
        Bench(BenchConfig(algos=["nosync", "dreamddp"]), tmp_path, echo=print).check_reuse()
    (tmp_path / "config.json").write_text(json.dumps({**was_auto, "algos": ["nosync", "localsgd"]}))
    Bench(BenchConfig(algos=["nosync", "localsgd", "dreamddp"]), tmp_path, echo=print).check_reuse()
    recorded = Bench(BenchConfig(algos=["localsgd", "dreamddp+int4"]), tmp_path, echo=print).recorded()
    assert recorded["lr_scales"] == {"localsgd": "1", "dreamddp": "1"}
    (tmp_path / "config.json").write_text(json.dumps(recorded))  # made now: kept
    Bench(BenchConfig(algos=["localsgd", "dreamddp+int4"]), tmp_path, echo=print).check_reuse()


def test_soak_refuses_a_bad_model_option_and_passes_a_good_one_to_both_runs():
    from pathlib import Path

    from geotrain.bench.soak import SoakJob
    from helpers import refused

    err = refused(["soak", "--model", "tiny", "--model-config", "n_lyer=2", "--out", "/nonexistent"])
    assert "--model-config n_lyer: tiny takes dropout, n_embd" in err
    job = SoakJob(model="tiny", extra=("--model-config", "n_layer=1", "--lora", "r=2,alpha=4,targets=c_attn"))
    argv = job.argv(Path("/tmp/x"))
    assert argv[-4:] == ["--model-config", "n_layer=1", "--lora", "r=2,alpha=4,targets=c_attn"]
    # --H auto (SparseLoCo's and DreamDDP's default) soaks as it runs; a bad period is refused
    err = refused(["soak", "--H", "often", "--out", "/nonexistent"])
    assert "--H: takes a period >= 1, 0 (the algorithm's default) or auto" in err
    assert "--steps must be >= 1" in refused(["soak", "--H", "auto", "--steps", "0", "--out", "/nonexistent"])
    from geotrain.cli_bench import _soak_H

    assert _soak_H("auto") == "auto" and _soak_H("20") == 20
    assert SoakJob(H="auto").argv(Path("/tmp/x"))[9:11] == ["--H", "auto"]


@pytest.mark.usefixtures("no_leftovers")
def test_the_benchs_profile_times_the_codecs_its_cells_are_priced_with(tmp_path):
    """A codec cell's prediction has the codec's encoding and decoding in it: the profile the
    bench takes times every codec its priced cells use (``--profile-codecs``), once each."""
    from geotrain.plan.codec_time import codec_key

    algos = ["nosync", "ssgd+int8", "diloco+acpsgd:rank=4", "localsgd+int8", "dreamddp+auto", "ssgd+none"]
    bench = Bench(BenchConfig(algos=algos, workers=[2], bandwidths=["100mbit"], netem=False), tmp_path)
    assert bench.priced_codecs() == ["int8", "acpsgd:rank=4"]
    profile = bench.profile(2, "100mbit")
    assert set(profile["codecs"]) == {codec_key("int8"), codec_key("acpsgd:rank=4")}
    for timed in profile["codecs"].values():
        assert timed["workers"] == 2 and len(timed["layers"]) == len(profile["layers"])
        assert all(s > 0 for s in timed["layers"].values())
    # a rerun that adds a codec cell keeps the profile, and says what it does not time
    said: list[str] = []
    more = BenchConfig(algos=[*algos, "ssgd+int4"], workers=[2], bandwidths=["100mbit"], netem=False)
    rerun = Bench(more, tmp_path, echo=said.append)
    assert rerun.profile(2, "100mbit") == profile and rerun.profile(2, "100mbit") == profile
    assert len(said) == 1 and "does not time int4" in said[0]


def test_profile_codecs_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="--profile-codecs: unknown codec 'int3'"):
        TrainConfig(algo="nosync", profile_out="p.json", profile_codecs="int8;int3")
    cfg = TrainConfig(algo="dreamddp", compress="int4", profile_codecs="int8; int4;none;")
    assert cfg.profile_codec_specs() == ["int4", "int8"]  # its own first, each once, fp32 not a codec
    # a bad --compress is its algorithm's to refuse, in its own words
    with pytest.raises(ConfigError, match="unknown codec 'int9'") as refused:
        TrainConfig(algo="ssgd", compress="int9")
    assert "--profile-codecs" not in str(refused.value)
