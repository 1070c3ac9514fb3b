"""A run across "real machines" on loopback: `geotrain broker` and one `geotrain train --broker`
process per machine, started by hand as a user would on each machine (no launcher, no torchrun).

The machine of the first epoch's rank 0 is lost; the broker finds it silent, the others go on,
a replacement started with `geotrain join` is admitted, and everyone, the broker included, exits 0.
And a spare started with `geotrain join --spare` before anything fails takes a lost one's place.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from geotrain.launch.coordinator import read_jsonl
from helpers import geotrain

GEOTRAIN = [sys.executable, "-m", "geotrain"]
TINY_FLAGS = ["--model", "tiny", "--batch-size", "4", "--no-progress", "--threads", "1"]
FLAGS = ["--algo", "localsgd", "--H", "4", "--model", "tiny", "--batch-size", "4", "--no-progress"]
FLAGS += ["--threads", "1", "--steps", "400"]
# The survivors wait at their boundary for the replacement: it is admitted however slowly it
# starts on a loaded machine (the run's 400 tiny steps last only some seconds).
FLAGS += ["--min-workers", "2", "--join-timeout", "60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _broker(tmp_path, hosts: int, port: int, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*GEOTRAIN, "broker", "--hosts", str(hosts), "--port", str(port), "--fault-timeout", "3",
         "--dir", str(tmp_path / "broker")],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


@pytest.mark.usefixtures("no_leftovers")
def test_a_broker_run_loses_its_first_rank_0_and_admits_a_replacement(tmp_path):
    """The run has a token: an intruder posing as host 0's replacement with another token is
    refused in one line before the real replacement is admitted, and the secret appears in no
    output, nor in any file of the broker's."""
    port = _free_port()
    secret = "s3cret-" + "5" * 40
    env = dict(os.environ, GEOTRAIN_TOKEN=secret)
    broker = _broker(tmp_path, 2, port, env)
    procs = []
    outputs = []
    try:
        for host in range(2):
            chaos = ["--chaos", "kill:step=5,rank=0"] if host == 0 else []
            cmd = [*GEOTRAIN, "train", "--broker", f"127.0.0.1:{port}", "--host", str(host)]
            cmd += ["--run-dir", str(tmp_path / f"machine{host}"), *FLAGS, *chaos]
            procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env))
        regroups = tmp_path / "machine1" / "control" / "regroups-h1.jsonl"
        deadline = time.monotonic() + 60
        while not regroups.exists():  # the survivors went on without host 0
            assert time.monotonic() < deadline, "no regroup within 60 s"
            time.sleep(0.2)
        # A second trainer for a host once the run is under way is refused in one line (checked
        # first: a `geotrain train` waits for a broker that is not up yet, or gone with the run).
        again = [*GEOTRAIN, "train", "--broker", f"127.0.0.1:{port}", "--host", "1", *FLAGS]
        refused = subprocess.run(again, capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 2 and "host 1 is already training" in refused.stderr, refused.stderr
        cmd = [*GEOTRAIN, "join", "--broker", f"127.0.0.1:{port}", "--host", "0"]
        intruder = subprocess.run(
            [*cmd, "--run-dir", str(tmp_path / "intruder"), *FLAGS],
            capture_output=True, text=True, timeout=60, env={**env, "GEOTRAIN_TOKEN": "a-guess"},
        )  # fmt: skip
        lines = intruder.stderr.strip().splitlines()
        assert intruder.returncode == 2 and len(lines) == 1, intruder.stderr
        assert "refused by the run: this worker's token" in lines[0]
        outputs += [intruder.stdout, intruder.stderr, refused.stderr]
        joiner = subprocess.Popen(
            [*cmd, "--run-dir", str(tmp_path / "machine0"), *FLAGS],
            stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        procs.append(joiner)
        # So is a "replacement" for a host that is still training, and the host it names trains on
        # (it never spoke for it).
        wrong = [*GEOTRAIN, "join", "--broker", f"127.0.0.1:{port}", "--host", "1", *FLAGS]
        refused = subprocess.run(
            [*wrong, "--fault-timeout-s", "2"], capture_output=True, text=True, timeout=60, env=env
        )
        assert refused.returncode == 2 and "host 1 is still training in this run" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        errs = [p.communicate(timeout=120)[1] for p in procs]
        outputs += [refused.stderr, *errs]
        assert procs[0].returncode == -9  # the chaos kill
        assert [p.returncode for p in procs[1:]] == [0, 0], [e[-2000:] for e in errs]
        assert broker.wait(timeout=30) == 0, broker.stderr.read()[-2000:]
        outputs.append(broker.stderr.read())
    finally:
        _kill_all([*procs, broker])
    files = [p.read_text(errors="replace") for p in (tmp_path / "broker").rglob("*") if p.is_file()]
    assert not any(secret in text for text in [*outputs, *files])
    admissions = read_jsonl(tmp_path / "broker" / "admissions.jsonl")
    assert [a["ok"] for a in admissions if "ok" in a and "used" not in a].count(False) == 1
    epochs = [json.loads(x) for x in (tmp_path / "broker" / "epochs.jsonl").read_text().splitlines()]
    assert [(e["members"], e["why"]) for e in epochs] == [([1], "silent"), ([1, 0], "requested")]
    summary = json.loads((tmp_path / "machine1" / "summary.json").read_text())  # rank 0 at the end
    assert (summary["workers_start"], summary["workers"]) == (2, 2)
    admitted = summary["membership"][1]
    # one member hands its state over (in two stripes from two: test_continue_cli's replacement)
    assert admitted["joined"] == [0] and admitted["stripes"]["model"] == 1
    assert "host 0 was admitted after step" in errs[2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--broker", "nohost", "--host", "0"], "--broker takes ADDR:PORT"),
        (["train", "--broker", "127.0.0.1:29400"], "--broker needs --host I"),
        (["join", "--host", "1"], "geotrain join needs --broker ADDR:PORT"),
    ],
)
def test_bad_broker_options_are_refused_with_one_line(args, message):
    proc = geotrain([*args, *FLAGS], timeout=60)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.long  # 19 s; CI has spares in test_spares.py, a token refused in the test above
def test_a_broker_runs_spare_replaces_a_lost_machine(tmp_path):
    """On "real machines": `geotrain join --spare` waits before anything fails; machine 1 is
    killed, found silent by the broker, and the spare takes its place; all exit 0. The run has
    a token: an intruder spare that registered first, with another token, is refused with one
    line and never given the place, and the secret appears in no output."""
    port = _free_port()
    where = ["--broker", f"127.0.0.1:{port}"]
    flags = [*TINY_FLAGS, "--algo", "localsgd", "--H", "4", "--steps", "40", "--min-workers", "2"]
    secret = "s3cret-" + "7" * 40
    env = dict(os.environ, GEOTRAIN_TOKEN=secret)
    broker = _broker(tmp_path, 2, port, env)
    procs = []
    try:
        intruder = [*GEOTRAIN, "join", "--spare", *where, "--run-dir", str(tmp_path / "x"), *flags]
        procs.append(
            subprocess.Popen(
                intruder, stderr=subprocess.PIPE, text=True, env={**env, "GEOTRAIN_TOKEN": "guess"}
            )
        )
        for host in range(2):
            chaos = ["--chaos", "kill:step=5,rank=1"] if host == 1 else []
            cmd = [*GEOTRAIN, "train", *where, "--host", str(host), "--run-dir", str(tmp_path / f"m{host}")]
            procs.append(subprocess.Popen([*cmd, *flags, *chaos], stderr=subprocess.PIPE, text=True, env=env))
        spare = [*GEOTRAIN, "join", "--spare", *where, "--run-dir", str(tmp_path / "spare"), *flags]
        procs.append(subprocess.Popen(spare, stderr=subprocess.PIPE, text=True, env=env))
        errs = [p.communicate(timeout=180)[1] for p in procs]
        assert [p.returncode for p in procs] == [2, 0, -9, 0], [e[-2000:] for e in errs]
        assert broker.wait(timeout=30) == 0, broker.stderr.read()[-2000:]
        said = broker.stderr.read()
    finally:
        _kill_all([*procs, broker])
    refusal = errs[0].strip().splitlines()
    assert len(refusal) == 1 and "refused by the run: this worker's token" in refusal[0], errs[0]
    errs = errs[1:]
    assert "geotrain: spare takes the place of host 1" in errs[2]
    logs = [*errs, said, *(p.read_text() for p in (tmp_path / "broker").glob("*") if p.is_file())]
    assert not any(secret in text for text in logs)
    admissions = read_jsonl(tmp_path / "broker" / "admissions.jsonl")
    assert [a["ok"] for a in admissions if "ok" in a and "used" not in a].count(False) == 1
    epochs = read_jsonl(tmp_path / "broker" / "epochs.jsonl")
    assert [(e["members"], e["why"]) for e in epochs] == [([0], "silent"), ([0, 1], "requested")]
    summary = json.loads((tmp_path / "m0" / "summary.json").read_text())
    assert (summary["workers_start"], summary["workers"]) == (2, 2)
    records = (tmp_path / "spare" / "metrics" / "rank1.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, records) if not r.get("final")]
    assert steps[-4:] == [37, 38, 39, 40]  # the spare trained host 1's part to the end
