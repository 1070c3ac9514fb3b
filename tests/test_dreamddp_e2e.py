"""DreamDDP as a user runs it: geotrain profile -> geotrain plan -> geotrain run --algo dreamddp."""

from __future__ import annotations

import json

import pytest

from helpers import geotrain, refused

JOB = ["--workers", "2", "--bandwidth", "20mbit", "--model", "tiny", "--batch-size", "16"]


def _geotrain(args, cwd, timeout=300):
    proc = geotrain(args, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _profile_plan_run(tmp_path):
    out = _geotrain(["profile", *JOB, "--out", "profile.json"], tmp_path)
    assert "all-reduce:" in out.stdout and "profiling took" in out.stdout
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["workers"] == 2 and len(profile["layers"]) == 16
    assert all(layer["shapes"] for layer in profile["layers"])  # what plan --compress prices from
    assert profile["profile_s"] < 30  # seconds, not minutes
    # hosts that share cores: the contention probe runs by default, and the wait for the slowest
    assert profile["contention_measured"] and "while backward runs" in out.stdout
    assert "for the slowest host" in out.stdout
    assert {"sync_wait_s", "comm_slowdown_in_backward", "interference_s_per_byte"} <= set(profile)

    out = _geotrain(
        ["plan", "--profile", "profile.json", "--H", "4", "--out", "plan.json", "--png", "plan.png"], tmp_path
    )
    assert "dreamddp schedule, H=4" in out.stdout
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    plan = json.loads((tmp_path / "plan.json").read_text())

    run = tmp_path / "run"
    if run.exists():
        import shutil

        shutil.rmtree(run)
    _geotrain(
        [
            "run",
            *JOB,
            "--algo",
            "dreamddp",
            "--plan",
            "plan.json",
            "--steps",
            "40",
            "--replan-threshold",
            "0",
            "--no-progress",
            "--run-dir",
            "run",
        ],
        tmp_path,
    )
    summary = json.loads((run / "summary.json").read_text())
    predicted = plan["predicted_s"]["dreamddp"]
    assert summary["predicted_step_s"] == pytest.approx(predicted)
    assert summary["syncs"] == 40  # every iteration averaged at least one layer
    return predicted, summary["step_s_mean"]


@pytest.mark.timing  # out of the suite (a timed check): pytest -m timing
@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
def test_measured_step_time_is_within_25_percent_of_the_plan(tmp_path):
    # Two hosts share this machine's two cores with whatever else runs; one profile-plan-run can
    # catch a noisy moment, so a miss is measured once more, from a fresh profile.
    attempts = []
    for _ in range(2):
        predicted, measured = _profile_plan_run(tmp_path)
        attempts.append(abs(measured - predicted) / predicted)
        if attempts[-1] <= 0.25:
            break
    assert min(attempts) <= 0.25, f"relative errors {attempts}"


# A run that plans at start-up without a plan: test_continue_cli's dreamddp case (3 hosts, one
# killed: it plans, re-plans for two, and reports its prediction).


PLAN_ERRORS = [
    (["--profile", "missing.json", "--H", "4"], "--profile missing.json: no such file"),
    (["--profile", "profile.json"], "give --H N or --choose"),
    (["--profile", "profile.json", "--H", "0"], "--H must be 1 to the number of layers (3), got 0"),
    (["--profile", "profile.json", "--H", "-1"], "--H must be 1 to the number of layers (3), got -1"),
    (["--profile", "profile.json", "--choose", "--budget", "0.5"], "--budget is a factor"),
    (["--profile", "bad.json", "--H", "2"], "is not JSON"),
    (
        ["--profile", "profile.json", "--H", "2", "--topology", "2x2,wan=5mbit", "--workers", "4"],
        "--topology gives the hosts and their links: drop --workers and --bandwidth",
    ),
    (["--profile", "profile.json", "--H", "2", "--topology", "2x2"], "the WAN rate (wan=RATE) is missing"),
    (
        ["--profile", "profile.json", "--H", "2", "--topology", "2x2,wan=5mbit", "--speed", "1.5"],
        "--speed is a fraction of nosync's step rate in (0, 1], got 1.5",
    ),
    (["--profile", "profile.json", "--H", "2", "--speed", "0.9"], "--speed chooses the periods on sites"),
    (["--profile", "profile.json", "--H", "2", "--compress", "int9"], "unknown codec 'int9'"),
    (["--profile", "profile.json", "--H", "2", "--H-schedule", "3x5"], "the periods must rise"),
    (["--profile", "profile.json", "--H", "2", "--compress", "powersgd:rank=2"], "no parameter shapes"),
]


@pytest.mark.parametrize("args,message", PLAN_ERRORS, ids=[" ".join(a) for a, _ in PLAN_ERRORS])
def test_plan_bad_input(tmp_path, monkeypatch, args, message):
    profile = {
        "version": 1,
        "model": "tiny",
        "workers": 2,
        "link": "20mbit",
        "network_mode": "netns",
        "batch_size": 8,
        "layers": [{"name": f"l{i}", "bytes": 1000, "backward_s": 0.001} for i in range(3)],
        "forward_s": 0.01,
        "optimizer_s": 0.001,
        "backward_total_s": 0.003,
        "allreduce": {"alpha_s": 0.001, "beta_s_per_byte": 1e-7},
    }
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.chdir(tmp_path)
    assert message in refused(["plan", *args])
    assert not (tmp_path / "plan.json").exists()


def test_dreamddp_rejects_a_missing_plan(tmp_path):
    proc = geotrain(
        ["run", "--algo", "dreamddp", "--plan", "nope.json", "--model", "tiny", "--run-dir", "r"],
        60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "plan 'nope.json' does not exist" in proc.stderr
    assert not (tmp_path / "r").exists()
