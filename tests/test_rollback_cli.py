"""Runs that go on through failures: `geotrain run --chaos ...` under `--on-failure rollback`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geotrain.ft.chaos import ChaosError, parse_chaos
from geotrain.netem.cluster import netem_unavailable_reason
from helpers import geotrain, refused

# a snapshot at every sync (by default they are at least 50 steps apart: sync/base.py)
JOB = ["--model", "tiny", "--batch-size", "4", "--no-progress", "--H", "4", "--snapshot-every", "4"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _steps(run_dir: Path, rank: int) -> list[int]:
    return [
        json.loads(x)["step"] for x in (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
    ]


NET = ["--bandwidth", "100mbit"] if netem_unavailable_reason() is None else ["--no-netem"]
LOCALSGD = [
    "run",
    "--workers",
    "3",
    "--algo",
    "localsgd",
    "--steps",
    "12",
    *JOB,
    *NET,
    "--on-failure",
    "rollback",
]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("undisturbed")
    proc = geotrain([*LOCALSGD, "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _summary(run_dir)["faults"] == []
    return _summary(run_dir)


@pytest.mark.usefixtures("no_leftovers")
# 45 s: `pytest -m long`. Rollback to the undisturbed end stays in CI (a lost host, below), and
# frozen and cut-off hosts under continue (test_continue_cli).
@pytest.mark.long
def test_killed_frozen_and_cut_off_workers_are_replaced_and_the_run_ends_as_if_undisturbed(
    tmp_path, cleanup_keepers, undisturbed
):
    """rank 0 of the first launch dies after step 5, then host 2's link is cut after step 9 (on
    emulated links; on loopback rank 1 freezes instead: SIGSTOP keeps its sockets open, no peer
    gets a reset, they would wait in their collective until its 600 s timeout). The exit is seen
    at once, the silence after --fault-timeout; each time every worker returns to the newest
    snapshot (steps 4 and 8) and the run ends bitwise as the undisturbed one. (Faults are a sync
    period apart: local SGD's workers run on to the next sync before a fault can stop them.)"""
    faulty = tmp_path / "faulty"
    cleanup_keepers.append((faulty, 3))
    netns = "--bandwidth" in NET
    chaos = "kill:step=5,rank=0;" + ("cut:step=9,host=2" if netns else "stop:step=9,rank=1")
    proc = geotrain([*LOCALSGD, "--run-dir", str(faulty), "--chaos", chaos, "--fault-timeout", "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all workers continue from step 4" in proc.stderr
    assert "all workers continue from step 8" in proc.stderr
    summary = _summary(faulty)
    assert summary["on_failure"] == "rollback"
    faults = summary["faults"]
    expected = [("kill", 0, 4), ("cut", 2, 8) if netns else ("stop", 1, 8)]
    assert [(f["kind"], f["rank"], f["rollback_to"]) for f in faults] == expected
    for f, fired_at in zip(faults, (5, 9), strict=True):
        assert f["at_step"] >= fired_at and f["steps_lost"] == f["at_step"] - f["rollback_to"]
        assert f["sources"] == ["keeper"] * 3
        assert f["recover_s"] is not None and f["recover_s"] > 0
    assert faults[0]["exit_code"] is not None and 0 <= faults[0]["detected_s"] < 30
    for f in faults[1:]:
        assert f["exit_code"] is None and 3 <= f["detected_s"] < 6
    assert summary["param_digest"] == undisturbed["param_digest"]
    assert _steps(faulty, 1) == [*range(1, 13), 12]  # each step once in the end, then the final evaluation
    assert json.loads((faulty / "faults.json").read_text()) == faults


@pytest.mark.usefixtures("no_leftovers")
def test_a_lost_host_is_rebuilt_from_its_peers_and_the_run_goes_on(tmp_path, cleanup_keepers):
    """Host 1 loses its trainer, keeper and disk after step 9: its state comes back from its ring
    neighbour's keeper, and the run ends as the undisturbed one."""
    job = ["run", "--workers", "2", "--algo", "diloco", "--steps", "12", *JOB, "--no-netem"]
    job += ["--redundancy", "ring", "--snapshot-every", "2", "--on-failure", "rollback"]
    whole, lost = tmp_path / "whole", tmp_path / "lost"
    cleanup_keepers.append((lost, 2))
    assert geotrain([*job, "--run-dir", str(whole)]).returncode == 0
    proc = geotrain([*job, "--run-dir", str(lost), "--chaos", "kill-host:step=9,host=1,restart=1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The survivor whose collective failed says so in one line; its traceback goes to its log.
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (fault,) = _summary(lost)["faults"]
    assert fault["kind"] == "kill-host" and fault["rank"] == 1
    assert fault["sources"] == ["keeper", "peers"]
    assert _summary(lost)["param_digest"] == _summary(whole)["param_digest"]


@pytest.mark.long  # (a failure that ends the run stays: one that repeats is not retried)
@pytest.mark.usefixtures("no_leftovers")
def test_past_max_faults_a_fault_ends_the_run(tmp_path, cleanup_keepers, monkeypatch):
    """Also: without root (links asked for, none to be had) the launcher says so in one line
    and runs on loopback, and the run directory records why."""
    import geotrain.launch.local as local

    monkeypatch.setattr(local, "netem_unavailable_reason", lambda: "not running as root")
    job = ["run", "--workers", "2", "--algo", "ssgd", "--steps", "6", *JOB, "--bandwidth", "100mbit"]
    run_dir = tmp_path / "max-faults"
    cleanup_keepers.append((run_dir, 2))
    proc = geotrain([*job, "--run-dir", str(run_dir), "--chaos", "kill:step=3,rank=1", "--max-faults", "0"])
    assert proc.returncode == 1 and "--max-faults 0" in proc.stderr, proc.stderr[-2000:]
    (fault,) = json.loads((run_dir / "faults.json").read_text())
    assert fault["rank"] == 1 and fault["at_step"] >= 3
    assert "cannot emulate links (not running as root); running on loopback, UNSHAPED" in proc.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert config["fallback_reason"] == "not running as root" and config["network_mode"] == "loopback"
    assert config["train"]["link"] == "loopback (unshaped)"


@pytest.mark.usefixtures("no_leftovers")
def test_a_failure_that_repeats_is_not_retried(tmp_path, cleanup_keepers):
    """Bad input found by the trainers (a plan for another model) fails every attempt alike: the
    run ends at the first fault, with the trainer's one-line reason."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schedule": {"H": 2}}))
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 2))
    job = ["run", "--workers", "2", "--algo", "dreamddp", "--plan", str(plan), "--steps", "6", *JOB]
    proc = geotrain([*job, "--no-netem", "--run-dir", str(run_dir)])
    assert proc.returncode == 1 and "does not fit this model" in proc.stderr, proc.stderr[-2000:]
    assert len(json.loads((run_dir / "faults.json").read_text())) == 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kill:step=3", "accepted: kill:step=S,rank=R"),
        ("kill:step=0,rank=1", "step must be >= 1"),
        ("kill:step=3,rank=5", "there are 2 workers"),
        ("kill-host:every=5s", "only kill takes every="),
        ("kill:every=soon", "not a duration"),
        ("explode:step=3,rank=1", "accepted:"),
        ("kill:step=3,rank=1,restart=x", "not a duration"),
    ],
)
def test_bad_chaos_specs_are_refused_with_one_line(spec, message):
    with pytest.raises(ChaosError, match=message):
        parse_chaos(spec, workers=2)


def test_chaos_specs_parse_and_print_back():
    faults = parse_chaos("kill:step=3,rank=1; kill-host:step=9,host=0,restart=2 ;kill:every=1m", workers=2)
    assert [f.spec() for f in faults] == [
        "kill:step=3,rank=1",
        "kill-host:step=9,host=0,restart=2",
        "kill:every=60s",
    ]
    assert [f.timed for f in faults] == [False, False, True]
    corrupt = "corrupt:every=1,rank=1,part=stamp;corrupt:step=2,rank=0,kind=signflip,part=shard"
    assert [f.spec() for f in parse_chaos(corrupt, workers=2)] == corrupt.split(";")
    assert [f.corruption for f in parse_chaos(corrupt)] == ["stamp", "signflip"]


def test_the_cli_refuses_bad_failure_options_with_one_line(tmp_path):
    for args, message in (
        (["--on-failure", "pray"], "--on-failure 'pray': accepted: continue, rollback, stop"),
        (["--min-workers", "3"], "--min-workers must be in [1, --workers 2]"),
        (["--max-faults", "-1"], "--max-faults must be >= 0"),
        (["--chaos", "kill:step=2,rank=9"], "there are 2 workers"),
        (["--fault-timeout", "1"], "--fault-timeout must be >= 2 seconds"),
        (["--chaos", "cut:step=2,host=1", "--no-netem"], "needs emulated links"),
    ):
        line = refused(["run", "--workers", "2", "--no-netem", "--run-dir", str(tmp_path / "x"), *args])
        assert message in line, line
        assert not (tmp_path / "x").exists()
