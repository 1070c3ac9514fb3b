"""The CLI end to end, as a user runs it: real processes, real torchrun, real namespaces where possible."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.metrics import read_metrics
from geotrain.netem.cluster import netem_unavailable_reason
from helpers import geotrain, refused

GEOTRAIN = [sys.executable, "-m", "geotrain"]


def _stray_processes(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "pgrep" not in ln]


@pytest.mark.usefixtures("no_leftovers")
def test_run_two_workers_trains_and_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    proc = geotrain(
        [
            "run",
            "--workers",
            "2",
            "--model",
            "tiny",
            "--steps",
            "20",
            "--bandwidth",
            "100mbit",
            "--eval-every",
            "10",
            "--run-dir",
            str(run_dir),
            # Worker 1 sends NaN at the outer step of step 10 (--chaos corrupt): the norm check
            # leaves it out, the run goes on finite, and the summary counts it. (Between two
            # workers it is off by default: given here.)
            "--max-norm-ratio",
            "10",
            "--chaos",
            "corrupt:step=10,rank=1,kind=nan",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "rank 1 corrupts its next contribution (nan) from step 10" in proc.stderr
    assert summary["rejected_updates"] == {"1": 1} and summary["max_norm_ratio"] == 10
    assert summary["network_mode"] == ("loopback" if netem_unavailable_reason() else "netns")
    assert summary["workers"] == 2 and summary["steps"] == 20
    assert f"run directory: {run_dir}" in proc.stdout
    assert "validation loss" in proc.stderr + proc.stdout  # the summary table
    for rank in (0, 1):
        records = read_metrics(run_dir / "metrics" / f"rank{rank}.jsonl")
        steps = [r for r in records if "train_loss" in r]
        assert [r["step"] for r in steps] == list(range(1, 21))
        # the default algorithm, diloco with H=10, moves bytes on its outer steps only
        assert [r["step"] for r in steps if r["sent_bytes"] > 0] == [10, 20]
        assert [r["step"] for r in steps if r["synced"]] == [10, 20]
        first = sum(r["train_loss"] for r in steps[:3]) / 3
        last = sum(r["train_loss"] for r in steps[-3:]) / 3
        assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
        assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    assert summary["final_val_loss"] < summary["first_train_loss"]
    assert (run_dir / "checkpoint.pt").exists()
    assert (run_dir / "logs" / "host1.log").exists()
    assert not _stray_processes(str(run_dir))


@pytest.mark.long  # (the second owner's path stays on gloo: test_guard.py; the CLI's owners too)
@pytest.mark.usefixtures("no_leftovers")
def test_a_second_owner_per_shard_leaves_out_a_flipped_shard_from_the_cli(tmp_path):
    """``--compress int4:owners=2`` on 3 workers, worker 2 flipping the sign of its shard of one
    mean (``--chaos corrupt:...,part=shard``), within what any norm allows: the pair of owners
    disagrees, every worker leaves that shard out, the summary names the pair, the replicas end
    as one model, and the run exits 0."""
    run_dir = tmp_path / "run"
    proc = geotrain(
        [
            *("run", "--workers", "3", "--no-netem", "--model", "tiny", "--steps", "6", "--eval-every", "0"),
            *("--algo", "ssgd", "--compress", "int4:owners=2", "--run-dir", str(run_dir)),
            *("--chaos", "corrupt:step=3,rank=2,kind=signflip,part=shard"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 2 corrupts its next shard of a mean (signflip) from step 3" in proc.stderr
    assert "hosts 2 and 0 computed different copies of shard 2 of an average" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["disputed_shards"] == {"2,0": 1} and summary["rejected_updates"] == {}
    digests = {
        r["param_digest"]
        for rank in range(3)
        for r in read_metrics(run_dir / "metrics" / f"rank{rank}.jsonl")
        if r.get("final")
    }
    assert len(digests) == 1  # (the bytes: test_guard's, against wire_bytes)


# Every algorithm runs end to end from the CLI in test_continue_cli (faults), test_resume_cli
# (localsgd with --H-schedule grow, resumed; ddp_powersgd, diloco), test_topology (nosync) and
# test_rollback_cli; every algorithm's state and survival in test_resume_gloo.


BAD_INPUTS = [
    (
        ["--algo", "adam"],
        "unknown algorithm 'adam'; accepted: ssgd, ddp, ddp_powersgd, localsgd, diloco, dreamddp, "
        "sparseloco, demo, streaming, co2, nosync",
    ),
    (["--model", "huge"], "unknown model 'huge'; accepted: tiny, mini, small, or hf:DIR / hf:TYPE"),
    (["--model-config", "width=9"], "--model-config width: tiny takes dropout, n_embd, n_head, n_layer"),
    (["--model-config", "n_layer"], "--model-config 'n_layer': expected NAME=VALUE"),
    (["--lora-fa"], "--lora-fa freezes LoRA's A matrices: give --lora too"),
    (["--lora", "r=0"], "--lora r must be an integer >= 1, got 0"),
    (["--lora", "rank=4"], "--lora 'rank=4': unknown 'rank'; accepted: r, alpha, targets, dropout"),
    (["--lora", "r=4,targets=q_proj"], "--lora targets q_proj: the model has no layer of that name"),
    (["--model", "hf:llama", "--model-config", "hiden_size=64"], "--model-config hiden_size: not a field"),
    (
        ["--algo", "diloco", "--H", "-1"],
        "--H: takes a period >= 1, 0 (the algorithm's default) or auto; got '-1'",
    ),
    (["--algo", "localsgd", "--H", "often"], "--H: takes a period >= 1, 0 (the algorithm's default) or auto"),
    (
        ["--algo", "localsgd", "--H", "auto"],
        "--H auto is dreamddp's and sparseloco's (each picks its period at start-up); give localsgd",
    ),
    (["--bandwidth", "100mbps"], "bandwidth '100mbps' is not understood; give a positive number with a unit"),
    (["--bandwidth", "-5mbit"], "bandwidth '-5mbit' is not understood"),
    (["--workers", "2", "--bandwidth", "1mbit,2mbit,3mbit"], "lists 3 rates for 2 workers"),
    (["--workers", "300"], "--workers must be 1 to 250"),
    (["--workers", "0"], "--workers must be 1 to 250"),
    (["--data", "/no/such/place"], "no such file or directory"),
    (["--latency", "50"], "latency '50' is not understood"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--algo", "ssgd", "--compress", "int9"], "unknown codec 'int9'; accepted: fp16, bf16, int8"),
    (["--algo", "ssgd", "--compress", "acpsgd:rank=0"], "acpsgd: rank must be an integer >= 1, got 0"),
    (["--algo", "localsgd", "--H-schedule", "2x"], "--H-schedule takes grow[:every=STEPS,start=P] or"),
    (["--algo", "ssgd", "--H-schedule", "grow"], "ssgd does not take --H-schedule"),
    (["--algo", "nosync", "--compress", "int8"], "nosync does not take --compress; algorithms that do: ssgd"),
    (["--backend", "mpi"], "--backend takes auto, nccl, gloo; got 'mpi'"),
    (["--algo", "ssgd", "--compress", "int4:owners=3"], "int4: owners (workers that compute each shard"),
    (
        ["--algo", "ssgd", "--chaos", "corrupt:step=2,rank=0,kind=signflip,part=shard"],
        "part=shard spoils a worker's shard of a quantised codec's mean (--compress int8|int4|sign); "
        "not an uncompressed average",
    ),
    (["--chaos", "corrupt:step=2,rank=0,part=all"], "[,part=shard|stamp]"),
    (["--chaos", "corrupt:step=2,rank=0,kind=nan,part=stamp"], "[,part=shard|stamp]"),
    (
        ["--algo", "ssgd", "--compress", "int4", "--chaos", "corrupt:step=2,rank=0,part=stamp"],
        "part=stamp sends a worker's copies of shards under a false owners' stamp (--compress "
        "int8|int4|sign with :owners=2); not --compress int4",
    ),
    (["--autocast", "fp8"], "--autocast takes off, bf16; got 'fp8'"),
]


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_gets_one_clear_line_and_exit_2(tmp_path, args, message):
    run_dir = tmp_path / "never"
    line = refused(["run", "--model", "tiny", "--run-dir", str(run_dir), *args])
    assert message in line and line.startswith("geotrain run: error:")
    assert not run_dir.exists()
    assert not _stray_processes(str(run_dir))


@pytest.mark.usefixtures("no_leftovers")
def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    proc = geotrain(
        ["run", "--model", "tiny", "--data", str(tmp_path / "empty"), "--run-dir", str(tmp_path / "r")]
    )
    assert proc.returncode == 2 and "no text found" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_unknown_command():
    proc = geotrain(["fly"])
    assert (
        proc.returncode == 2
        and "unknown command 'fly'; accepted: train, run, profile, plan, bench, soak, sweep" in proc.stderr
    )


def _start(run_dir: Path, steps: int = 100000) -> subprocess.Popen:
    return subprocess.Popen(
        GEOTRAIN
        + [
            "run",
            "--workers",
            "2",
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--bandwidth",
            "100mbit",
            "--algo",
            "ssgd",
            "--run-dir",
            str(run_dir),
            "--on-failure",  # these tests watch a run fail and clean up; rollback has its own
            "stop",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_and_sweep(proc: subprocess.Popen, run_dir: Path | None = None) -> None:
    """A launcher that did not stop in time must not leave a run going for the tests after it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        subprocess.run(GEOTRAIN + ["sweep"], capture_output=True, timeout=60)
    if run_dir is not None:
        _only_keepers_left_then_stop_them(run_dir)


def _only_keepers_left_then_stop_them(run_dir: Path) -> None:
    """After a failed or interrupted run only its keepers live on (holding its snapshots for
    --resume); stopping them leaves nothing."""
    from geotrain.launch.keepers import stop_keepers

    left = [ln for ln in _stray_processes(str(run_dir)) if "geotrain.ft.keeper" not in ln]
    stop_keepers(run_dir, 2)
    deadline = time.monotonic() + 10
    while _stray_processes(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def _wait_for_training(run_dir: Path, proc: subprocess.Popen, timeout=90.0) -> None:
    metrics = run_dir / "metrics" / "rank1.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)


@pytest.mark.usefixtures("no_leftovers")
def test_ctrl_c_stops_hosts_and_removes_namespaces(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    try:
        _wait_for_training(run_dir, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        _kill_and_sweep(proc, run_dir)
    assert proc.returncode == 130
    assert "interrupted; hosts stopped, namespaces removed" in err
    assert not _stray_processes(str(run_dir))


@pytest.mark.usefixtures("no_leftovers")
def test_a_collective_past_its_timeout_ends_the_run_in_one_line_not_tracebacks(tmp_path, cleanup_keepers):
    """Host 1 freezes; host 0's gradient all-reduce (inside PyTorch DDP's backward) outlasts
    --timeout-s: it says so in one line naming the collective, the limit, the links and the
    option, and the launcher ends the run with that line (a run at 350 kbit/s once ended in 274
    lines of tracebacks from four ranks)."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 2))  # a failed run's keepers linger for a resume
    job = ["run", "--workers", "2", "--no-netem", "--model", "tiny", "--steps", "10", "--algo", "ddp"]
    job += ["--no-progress", "--on-failure", "stop", "--timeout-s", "2", "--fault-timeout", "3"]
    proc = geotrain([*job, "--run-dir", str(run_dir), "--chaos", "stop:step=3,rank=1"], timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = [ln for ln in proc.stderr.splitlines() if "waited longer than the collective timeout" in ln]
    assert said[0].startswith("geotrain train: error: host 0: a collective outside geotrain's Communicator")
    assert "of 2 s on loopback (unshaped)" in said[0] and "raise --timeout-s" in said[0]
    # The launcher names whichever host it found first (host 0 exited, or host 1 went silent).
    assert said[-1].startswith("geotrain: run failed: host ") and ": a collective outside" in said[-1]
    assert "Traceback" not in proc.stderr


# Without root the launcher says so and runs on loopback: test_rollback_cli's
# test_past_max_faults_a_fault_ends_the_run (one run carries both).


def test_the_disk_estimate_counts_each_hosts_state_and_the_checkpoint():
    """fp32 copies per state as measured on GPT mini's checkpoints (nosync 3.0, diloco
    --compress none 4.8, diloco with int4, its default, 6.0), and the bytes a finished and a
    stopped run write."""
    from geotrain.launch.disk import NoRoom, check_room, disk_need, state_copies

    assert state_copies("nosync") == state_copies("dreamddp", "none") == 3
    assert (
        state_copies("diloco", "none") == 5 and state_copies("diloco") == state_copies("diloco", "int4") == 6
    )
    assert state_copies("dreamddp", "int4") == 5 and state_copies("diloco", lora=True) == 1
    assert state_copies("dreamddp") == 5  # its default, --compress auto: what a codec would keep
    assert (
        state_copies("co2", bits=32) == 7 and state_copies("co2", bits=4) == 7.125
    )  # its start, its residual
    # its residuals, and (carry) a fragment at its launch
    assert state_copies("streaming", bits=32) == 6.25 and state_copies("streaming") == 7.25
    need = disk_need(10_893_312, 4, "dreamddp", "none")
    assert need.state_bytes == 4 * 10_893_312 * 3  # 130.7 MB, as the run's snapshot file (130.8 MB)
    assert need.finished == 5 * need.state_bytes and need.stopped == 9 * need.state_bytes
    # --checkpoint-every: each keeper keeps its two newest states on disk, finished or not
    assert disk_need(10_893_312, 4, "dreamddp", "none", periodic=True).finished == need.stopped
    assert check_room(Path("runs/x"), need, free=need.stopped) == ""
    assert "a run stopped unfinished writes up to 1.2 GB" in check_room(
        Path("runs/x"), need, free=need.stopped - 1
    )
    with pytest.raises(NoRoom, match=r"has 653.6 MB free, and this run writes about 653.6 MB"):
        check_room(Path("runs/x"), need, free=need.finished - 1)


def test_a_run_whose_files_would_not_fit_on_the_disk_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """A run of mini that trained all its steps and then died writing its checkpoint on a full
    disk lost the model: the launcher now refuses to start one, and makes no run directory."""
    import geotrain.launch.disk as disk

    monkeypatch.setattr(disk, "free_bytes", lambda path: 300_000_000)
    run_dir = tmp_path / "run"
    line = refused(
        [
            "run",
            "--workers",
            "4",
            "--no-netem",
            "--model",
            "mini",
            "--algo",
            "dreamddp",
            "--compress",
            "none",  # fp32: the states measured (its default's codec adds a residual and references)
            "--steps",
            "5",
            "--run-dir",
            str(run_dir),
        ]
    )
    assert f"the disk under {run_dir} has 300.0 MB free, and this run writes about 653.6 MB" in line
    assert "a 130.7 MB state for each of 4 hosts" in line and "--run-dir on another disk" in line
    assert not run_dir.exists()


def test_drop_states_removes_a_runs_snapshots_and_checkpoint_and_keeps_its_metrics(tmp_path):
    from geotrain.launch.disk import drop_states

    (tmp_path / "snapshots" / "rank0").mkdir(parents=True)
    (tmp_path / "snapshots" / "rank0" / "step00000010.snap").write_bytes(b"x" * 1000)
    (tmp_path / "checkpoint.pt").write_bytes(b"y" * 500)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank0.jsonl").write_text("{}\n")
    (tmp_path / "summary.json").write_text("{}\n")
    assert drop_states(tmp_path) == 1500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics", "summary.json"]
    assert drop_states(tmp_path) == 0  # nothing left to remove
