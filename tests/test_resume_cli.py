"""Resume and snapshots as a user runs them: `geotrain run`, a killed worker, `geotrain run --resume`."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.ft.keeper import KeeperClient, disk_path
from geotrain.launch.keepers import keeper_socket
from geotrain.netem.cluster import netem_unavailable_reason
from helpers import geotrain, refused

GEOTRAIN = [sys.executable, "-m", "geotrain"]
# a snapshot at every sync (by default they are at least 50 steps apart: sync/base.py)
JOB = ["--model", "tiny", "--batch-size", "4", "--no-progress", "--H", "4", "--snapshot-every", "4"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _keepers_alive(run_dir: Path, n: int) -> list[bool]:
    return [KeeperClient(keeper_socket(run_dir, i), timeout_s=2).alive() for i in range(n)]


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.usefixtures("no_leftovers")
def test_a_killed_trainer_resumes_from_its_keepers_memory_exactly(tmp_path, cleanup_keepers):
    net = ["--bandwidth", "100mbit"] if netem_unavailable_reason() is None else ["--no-netem"]
    job = ["run", "--workers", "2", "--algo", "diloco", "--steps", "16", *JOB, *net]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cleanup_keepers.append((killed, 2))
    proc = geotrain([*job, "--run-dir", str(whole)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(_keepers_alive(whole, 2)), "a finished run stops its keepers"

    chaos = ["--chaos", "kill:step=10,rank=1", "--on-failure", "stop"]
    proc = geotrain([*job, "--run-dir", str(killed), *chaos])
    assert proc.returncode == 1
    # as a machine that dies: the launcher names the host and how its trainer ended
    assert "run failed: host" in proc.stderr and "exited with code" in proc.stderr
    assert "geotrain run --resume" in proc.stderr
    assert _keepers_alive(killed, 2) == [True, True], "keepers outlive the trainers"
    # The launcher had each keeper write its newest complete state to disk (a --resume after the
    # keepers are gone); the resume below still reads the keepers' memory first.
    snaps = killed / "snapshots"
    on_disk = sorted(p.relative_to(snaps).as_posix() for p in snaps.rglob("*.snap"))
    assert {"rank0/step00000004.snap", "rank1/step00000004.snap"} <= set(on_disk), on_disk  # step 8: maybe
    assert "is on disk" in proc.stderr

    proc = geotrain(["run", "--resume", str(killed)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = _summary(killed)["resumed_from"]
    assert resumed["sources"] == ["keeper", "keeper"] and resumed["step"] in (4, 8)
    assert _summary(killed)["param_digest"] == _summary(whole)["param_digest"]
    steps = [json.loads(x)["step"] for x in (killed / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert steps == [*range(1, 17), 16]  # each step once, then the final evaluation


@pytest.mark.usefixtures("no_leftovers")
def test_a_run_stopped_by_ctrl_c_resumes_from_disk_after_its_keepers_are_gone(tmp_path):
    """Ctrl-C (or --timeout, the same path) stops a healthy run: its keepers write each worker's
    newest snapshot to disk before they linger, so a --resume days later (the keepers long
    gone) goes on from it."""
    import signal

    from geotrain.ft.keeper import disk_steps
    from geotrain.launch.keepers import stop_keepers

    run = tmp_path / "run"
    job = ["run", "--workers", "2", "--no-netem", "--algo", "ddp", *JOB, "--snapshot-every", "5"]
    proc = subprocess.Popen(
        [*GEOTRAIN, *job, "--steps", "100000", "--run-dir", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        metrics = run / "metrics" / "rank1.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            try:
                step = json.loads(lines[-1]).get("step", 0) if lines else 0
            except ValueError:  # a line half written
                step = 0
            if step >= 12:  # snapshots of 5 and 10 taken
                break
            time.sleep(0.5)
        assert proc.poll() is None and step >= 12, "the run never reached step 12"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "is on disk" in stderr, stderr[-2000:]
    stop_keepers(run, 2)  # as after the linger: nothing left in memory
    steps = [disk_steps(run / "snapshots", r) for r in (0, 1)]
    # The Ctrl-C may find one worker a snapshot ahead ([10, 15] and [5, 10]): the resume takes
    # the newest step both have, as the launcher's line named it.
    common = sorted(set(steps[0]) & set(steps[1]))
    assert common and common[-1] >= 10, steps
    step = common[-1]
    assert f"every worker's state at step {step} is on disk" in stderr, stderr[-2000:]
    done = geotrain(["run", "--resume", str(run), "--steps", str(step + 5)], timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = _summary(run)["resumed_from"]
    assert resumed["sources"] == ["disk", "disk"] and resumed["step"] == step
    assert _summary(run)["steps"] == step + 5


def test_bad_resumes_are_refused_with_one_line_and_change_nothing(tmp_path):
    """Also local SGD from the CLI under --H-schedule grow with H=4 over 8 steps: 2 for a tenth
    of them (at least 1 step, to 4, where 2 and 4 both sync), then 4: syncs at 2, 4, 8; resumed
    for more steps with the flag as first given (grow was resolved and saved)."""
    run_dir = tmp_path / "run"
    job = ["run", "--workers", "2", "--algo", "localsgd", "--H-schedule", "grow", "--steps", "8", *JOB]
    proc = geotrain([*job, "--no-netem", "--run-dir", str(run_dir), "--checkpoint-every", "4"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = _summary(run_dir)
    assert summary["algo"] == "localsgd" and summary["network_mode"] == "loopback"
    assert summary["syncs"] == 3 and summary["periods"] == "H 2 from step 0, 4 from step 4"
    assert [p.name for p in sorted((run_dir / "snapshots" / "rank0").iterdir())] == [
        "step00000004.snap",
        "step00000008.snap",
    ]
    # Corrupt rank 0's newest snapshot: the previous good one is named.
    path = disk_path(run_dir / "snapshots", 0, 8)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = _tree_digest(run_dir)
    cases = [
        (["run", "--resume", str(tmp_path / "nope")], "not a geotrain run directory"),
        (["run", "--resume", str(run_dir), "--model", "mini"], "made with model='tiny', not 'mini'"),
        (["run", "--resume", str(run_dir), "--workers", "3"], "the run has 2 workers, not 3"),
        (["run", "--resume", str(run_dir), "--algo", "diloco"], "algo='localsgd'"),
        (["run", "--resume", str(run_dir)], "fails its checksum; the previous good snapshot is step 4"),
        (
            ["run", "--resume", str(run_dir), "--resume-step", "4", "--steps", "3"],
            "below the snapshot's step 4",
        ),
    ]
    for args, message in cases:
        assert message in refused(args), args
    assert _tree_digest(run_dir) == before
    # The named step resumes.
    resume = ["run", "--resume", str(run_dir), "--resume-step", "4", "--steps", "10", "--H-schedule", "grow"]
    proc = geotrain(resume)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _summary(run_dir)["resumed_from"]["step"] == 4 and _summary(run_dir)["steps"] == 10
    assert _summary(run_dir)["periods"] == "H 2 from step 0, 4 from step 4"


@pytest.mark.usefixtures("no_leftovers")
def test_finished_runs_always_exit_0(tmp_path):
    """A gloo abort at interpreter exit (`terminate called without an active exception`) once
    failed a finished ddp run: every repetition must exit 0 with nothing on stderr about it.
    (ddp itself finishes e2e in test_continue_cli's runs, which check their exit code too.)"""
    net = ["--bandwidth", "100mbit"] if netem_unavailable_reason() is None else ["--no-netem"]
    for i, algo in enumerate(["ddp_powersgd"]):
        run_dir = tmp_path / f"r{i}"
        start = time.monotonic()
        job = ["run", "--workers", "2", "--algo", algo, "--steps", "3", *JOB, *net, "--run-dir", str(run_dir)]
        # A process of its own: its exit is what is tested.
        proc = subprocess.run(GEOTRAIN + job, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, (algo, proc.stderr[-2000:])
        logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("host*.log"))
        assert "terminate called" not in logs and "SIGABRT" not in logs
        assert time.monotonic() - start < 120
