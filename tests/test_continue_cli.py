"""Survivors go on: `geotrain run --chaos ...` under `--on-failure continue` (the default).

Each run loses workers mid-training and must finish, exit 0, leave nothing behind, and say in its
summary who was lost, when, how long finding and regrouping took, and who trained to the end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from geotrain.netem.cluster import netem_unavailable_reason
from helpers import geotrain

BASE = ["--model", "tiny", "--batch-size", "4", "--no-progress", "--H", "4"]
JOB = [*BASE, "--no-netem"]
LONG = pytest.mark.long  # left out of `make test` (15 minutes): `pytest -m long`
NETNS = netem_unavailable_reason() is None


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _records(run_dir: Path, host: int) -> list[dict]:
    lines = (run_dir / "metrics" / f"rank{host}.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if not json.loads(x).get("final")]


def _one_final_model(run_dir: Path, hosts: int | list[int]) -> bool:
    """Every host (``hosts``: the first N, or these) wrote its final record, and their
    parameters hash the same."""
    which = list(range(hosts)) if isinstance(hosts, int) else hosts
    finals = [
        json.loads(x)
        for h in which
        for x in (run_dir / "metrics" / f"rank{h}.jsonl").read_text().splitlines()
        if json.loads(x).get("final")
    ]
    return len(finals) == len(which) and len({f["param_digest"] for f in finals}) == 1


@pytest.mark.usefixtures("no_leftovers")
def test_losing_the_first_rank_0_and_then_a_silent_host_the_others_train_to_the_end(
    tmp_path, cleanup_keepers
):
    """PyTorch DDP on 4 workers: rank 0 of the first epoch (whose torchrun hosted the rendezvous)
    is killed after step 4, host 2's link is cut after step 8 (on loopback: it freezes with
    SIGSTOP). No reset reaches its peers, which wait inside DDP's backward: the new epoch must
    reach them there. Two new epochs; hosts 1 and 3 train every step to the end, nobody redoes a
    finished step, and the summary comes from host 1, rank 0 of the last epoch."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 4))
    silent = ("cut", "cut:step=8,host=2") if NETNS else ("stop", "stop:step=8,rank=2")
    chaos = f"kill:step=4,rank=0;{silent[1]}"
    t0 = time.monotonic()
    net = ["--bandwidth", "100mbit"] if NETNS else ["--no-netem"]
    job = ["run", "--workers", "4", "--algo", "ddp", "--steps", "12", *BASE, *net, "--fault-timeout", "3"]
    proc = geotrain([*job, "--run-dir", str(run_dir), "--chaos", chaos])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    summary = _summary(run_dir)
    assert summary["on_failure"] == "continue"
    assert (summary["workers_start"], summary["workers"]) == (4, 2)
    faults = summary["faults"]
    assert [(f["kind"], f["rank"]) for f in faults] == [("kill", 0), (silent[0], 2)]
    assert faults[0]["detected_s"] < 3 and 3 <= faults[1]["detected_s"] < 6  # exit vs heartbeat
    assert all(f["steps_lost"] == 0 and f["recover_s"] < 10 for f in faults)
    epochs = summary["membership"]
    assert [(e["epoch"], e["members"]) for e in epochs] == [(1, [1, 2, 3]), (2, [1, 3])]
    # Host 2 goes silent right after its step 8, and a survivor may still miss the last of that
    # step's all-reduce from it. A survivor that finished step 8 leads: the other takes its state
    # (a record with the new group's size and no loss of its own). If neither finished it, both
    # redo it on two workers. Either way no finished step is redone.
    records = {host: _records(run_dir, host) for host in (1, 3)}
    workers = {host: [r["workers"] for r in rs] for host, rs in records.items()}
    finished_with = max(w[7] for w in workers.values())  # workers that step 8 counts
    assert [e["step"] for e in epochs] == [4, 8 if finished_with == 3 else 7]
    for host, rs in records.items():
        assert [r["step"] for r in rs] == list(range(1, 13))
        assert workers[host] == [4] * 4 + [3] * 3 + [workers[host][7]] + [2] * 4
        assert workers[host][7] == finished_with or math.isnan(rs[7]["train_loss"])  # adopted
    # Tokens follow the live workers: 4 steps of 4 workers, 4 of 3 (or 3 and 1 of 2), 4 of 2.
    per_worker_step = records[1][0]["tokens"] // 4
    expected = per_worker_step * (4 * 4 + 3 * 3 + finished_with + 2 * 4)
    assert summary["tokens"] == records[1][-1]["tokens"] == records[3][-1]["tokens"] == expected
    assert f"geotrain: host 2 failed after step 8 ({silent[0]}); the 2 others go on without it" in proc.stderr


@pytest.mark.parametrize(
    "algo, extra, chaos",
    [
        # a snapshot at every sync (by default at least 50 steps apart): step 4's is shipped
        (
            "diloco",
            ["--compress", "int4", "--redundancy", "ring", "--snapshot-every", "4"],
            "kill:step=6,rank=2",
        ),
        ("dreamddp", [], "kill:step=5,rank=1"),
        # (`-m long`: the warm start's redone step is ssgd's path)
        pytest.param("localsgd", ["--warm-start", "6"], "kill:step=3,rank=1", marks=LONG),
        # Step 8's gather is in flight (overlap) when the loss is found: gathered again by two.
        ("sparseloco", ["--overlap"], "kill:step=6,rank=2"),
        # step 7's gather fails and is redone by two (`-m long`: the per-step redo is ssgd's too)
        pytest.param("demo", [], "kill:step=6,rank=2", marks=pytest.mark.long),
        # A fragment lands every 2 steps, each sent a step before (tau 1): lock-stepped members.
        ("streaming", ["--H", "4", "--fragments", "2"], "kill:step=6,rank=2"),
        # step 4's mean in flight, landed at 8 by two (`-m long`: test_elastic.py regroups co2)
        pytest.param("co2", ["--H", "4", "--tau", "4"], "kill:step=6,rank=2", marks=LONG),
        # step 8's mean lands inside the next period (tau 2): its wait at step 10 fails, and the
        # two survivors gather it again there (`-m long`: a landing sent again is SparseLoCo's above)
        pytest.param("co2", ["--H", "4", "--tau", "2"], "kill:step=6,rank=2", marks=LONG),
        # --site-H 2 in sites 0,0,1: host 0's site average at step 6 fails with its site-mate;
        # host 2 (a site of one) runs on to step 8, whose sync fails: host 0, a collective behind,
        # adopts its state (theta_outer included: its sync failed) and the two redo step 8's.
        ("diloco", ["--site-H", "2", "--sites", "0,0,1", "--hierarchy", "sites"], "kill:step=5,rank=1"),
    ],
)
@pytest.mark.usefixtures("no_leftovers")
def test_each_kind_of_algorithm_goes_on_without_a_killed_worker(
    tmp_path, cleanup_keepers, algo, extra, chaos
):
    """Periodic methods keep the survivors' local progress (host 2 dies after step 6; the sync at
    step 8 fails and is redone by the two others: no step is repeated); DreamDDP re-plans for two
    workers (DDP's new wrapper is tested in test_elastic.py); in a warm start (synchronous steps)
    the step whose gradients could not be averaged is redone. SparseLoCo gathers its message in
    flight again among the survivors; DeMo redoes the step whose gather failed. Every survivor
    ends with the same parameters."""
    run_dir = tmp_path / algo
    cleanup_keepers.append((run_dir, 3))
    job = ["run", "--workers", "3", "--algo", algo, "--steps", "10", *JOB, *extra]
    proc = geotrain([*job, "--run-dir", str(run_dir), "--chaos", chaos])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    (fault,) = summary["faults"]
    (epoch,) = summary["membership"]
    assert summary["workers"] == 2 and fault["steps_lost"] == 0
    # No step is done twice and every survivor reaches the end. Between syncs nothing blocks an
    # overlapped method (sparseloco's gather lands a period late), so one survivor may run past
    # the next boundary before it hears of the loss: the other, a period behind, then adopts its
    # state (recording the step it adopted) instead of doing those steps itself.
    steps = {h: [r["step"] for r in _records(run_dir, h)] for h in epoch["members"]}
    assert any(s == list(range(1, 11)) for s in steps.values()), steps
    assert all(s == sorted(set(s)) and s[-1] == 10 for s in steps.values()), steps
    assert _one_final_model(run_dir, epoch["members"])
    if algo == "diloco" and "--site-H" in extra:
        assert epoch["behind"] == [0] and epoch["leader"] == 2  # it adopted host 2's state
    elif algo == "diloco":
        assert epoch["step"] == 8 and epoch["at_step"] == 8  # the sync of step 8, redone
        # Ring copies go on between the two survivors: redundancy is still on at the end (it
        # used to stop at the first change). Step 4's shipment, among three, may have been
        # travelling when host 2 died: then it is reported (or left behind), and only it.
        errors = summary["snapshot_errors"]
        assert all("step 4 " in e for e in errors), errors
        assert summary["redundancy"] == "ring" and summary["snapshots_shipped"] >= 1
    if algo == "dreamddp":  # planned at start-up (no --plan), and again for two
        assert summary["replans"] >= 1 and summary["predicted_step_s"] > 0
    if algo == "localsgd":  # step 4's gradient average failed: redone by two, then periodic
        assert (epoch["step"], epoch["at_step"]) == (3, 4)
        assert summary["syncs"] == 6 + 1 + 1  # the warm start's steps, step 8, the end
    assert summary["final_val_loss"] < summary["first_train_loss"]


@pytest.mark.parametrize(
    "algo, chaos, period",
    [
        # The first epoch's rank 0 comes back. (Local SGD's admission at a multiple of H is the
        # same path; its agreement on the boundary is tested in test_elastic.py.)
        ("ddp", "kill:step=4,rank=0,restart=0.5", 1),
        # In a warm start (synchronous to the end here) a joiner is admitted at the next step,
        # and takes the optimizer too: every replica ends bitwise the same.
        # (`-m long`: the admission is ddp's above, the state adopted is checked in test_elastic.py)
        pytest.param("diloco", "kill:step=4,rank=2,restart=0.5", 1, marks=pytest.mark.long),
    ],
)
@pytest.mark.usefixtures("no_leftovers")
def test_a_replacement_is_admitted_at_a_sync_boundary_with_the_members_state_bitwise(
    tmp_path, cleanup_keepers, algo, chaos, period
):
    """The killed host's replacement starts half a second later, asks to join, and is admitted
    where every member has finished a sync (for local SGD, a multiple of H): it receives their
    state in stripes, and every member's parameters hash the same there. It trains to the end,
    ranked after the survivors, so the summary still comes from a survivor with the whole run.
    On shaped links where the machine allows: a hand-over slower than the 50 ms poll of a
    collective's wait (a point-to-point transfer must not be polled: gloo fails it)."""
    run_dir = tmp_path / algo
    cleanup_keepers.append((run_dir, 3))
    lost = int(chaos.split("rank=")[1].split(",")[0])
    net = ["--bandwidth", "100mbit"] if NETNS else ["--no-netem"]
    steps = 160  # the replacement is admitted near step 50 (it starts in ~4 s)
    job = ["run", "--workers", "3", "--algo", algo, "--steps", str(steps), *BASE, *net]
    if algo == "diloco":
        job += ["--warm-start", str(steps)]
    proc = geotrain([*job, "--run-dir", str(run_dir), "--chaos", chaos])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    (fault,) = summary["faults"]
    left, joined = summary["membership"]
    assert (summary["workers_start"], summary["workers"]) == (3, 3)
    survivors = [h for h in range(3) if h != lost]
    assert left["members"] == survivors and joined["members"] == [*survivors, lost]
    assert joined["joined"] == [lost] and joined["behind"] == [lost]
    s = joined["step"]
    assert s % period == 0 and fault["rejoined_after_step"] == s and 0 < fault["rejoin_s"] < 60
    # Stripes from both survivors where their copies are bitwise equal (all of it under DDP).
    assert joined["stripes"]["model"] == 2 and joined["handed_over_bytes"] > 0
    views = [
        e
        for h in range(3)
        for e in map(json.loads, (run_dir / "control" / f"regroups-h{h}.jsonl").read_text().splitlines())
        if e["epoch"] == 2
    ]
    assert sorted(v["host"] for v in views) == [0, 1, 2]
    digests = {v["param_digest"] for v in views}
    assert len(digests) == 1
    assert len({v["shared_digest"] for v in views}) == 1  # what it holds equal: its parameters
    assert joined["param_digests"] == joined["shared_digests"] == 1
    for h in survivors:
        assert [r["step"] for r in _records(run_dir, h)] == list(range(1, steps + 1))
    after = [r for r in _records(run_dir, lost) if r["step"] > s]
    assert [r["step"] for r in after] == list(range(s + 1, steps + 1))
    assert {r["workers"] for r in after} == {3}
    assert f"geotrain: host {lost} was admitted after step {s}" in proc.stderr
    # The replacement's snapshots go to its host's keeper, naming the members: its final one is
    # on disk, where a resume finds it.
    members = run_dir / "snapshots" / f"rank{lost}" / f"step{steps:08d}.members"
    assert sorted(json.loads(members.read_text())) == [0, 1, 2]
    if NETNS:  # 1.7 MB at 100 Mbit/s: over a tenth of a second
        assert joined["hand_over_s"] > 0.1
    assert joined["stripes"].get("optimizer") == 2  # equal on both members: from both
    assert _one_final_model(run_dir, 3)


# (`-m long`: with LoRA, 30 s; the hand-over of an anchor is the full model's path below)
@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=LONG)])
@pytest.mark.usefixtures("no_leftovers")
def test_a_sparseloco_joiner_under_overlap_gets_the_anchor_not_the_model_and_ends_as_one_model(
    tmp_path, cleanup_keepers, lora
):
    """Under overlap each member's parameters are its own (its period started from the anchor
    minus its message in flight), so the joiner is handed the anchor and the members' shared
    state, not a model: what every member holds equal at the admission is the anchor
    (``shared_digests``), the hand-over is under the anchor and the model together, no optimizer
    travels (each worker's AdamW is its own), and the end-of-run average makes one model.
    With LoRA the anchor is the adapters', and the frozen base stays home: the joiner built it
    from the same seed, bitwise the members' (by digest), so nothing of it travels."""
    run_dir = tmp_path / "sparseloco"
    cleanup_keepers.append((run_dir, 3))
    steps = 40  # the survivors wait for the replacement at the boundary (--min-workers 3)
    adapters = ["--lora", "r=2,alpha=4,targets=c_attn", "--chunk", "256", "--k", "8"] if lora else []
    job = ["run", "--workers", "3", "--algo", "sparseloco", "--overlap", "--steps", str(steps), *JOB]
    job += adapters
    job += ["--min-workers", "3", "--join-timeout", "60", "--chaos", "kill:step=4,rank=2,restart=0.5"]
    proc = geotrain([*job, "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    joined = summary["membership"][-1]
    assert joined["members"] == [0, 1, 2] and joined["joined"] == [2] and joined["behind"] == [2]
    s = joined["step"]
    assert s % 4 == 0 and s < steps
    views = [
        e
        for h in range(3)
        for e in map(json.loads, (run_dir / "control" / f"regroups-h{h}.jsonl").read_text().splitlines())
        if e["epoch"] == 2
    ]
    assert sorted(v["host"] for v in views) == [0, 1, 2]
    assert len({v["shared_digest"] for v in views}) == 1 and joined["shared_digests"] == 1
    anchor = 4 * summary["trainable_parameters"]  # fp32 (in chunks: tiny's small tensors pad more)
    base = 4 * (summary["parameters"] - summary["trainable_parameters"])  # LoRA's frozen base
    # no copy of the trained values beside the anchor (32 KiB: the state's other fields), nor
    # of the base the joiner holds already
    assert anchor < joined["handed_over_bytes"] < 2 * anchor + 32768, joined
    assert not lora or joined["handed_over_bytes"] < base // 10, joined
    # no optimizer (each worker's own); the model part: what is not trained and differs
    assert "optimizer" not in joined["stripes"] and joined["stripes"]["model"] == 2
    after = [r for r in _records(run_dir, 2) if r["step"] > s]
    assert [r["step"] for r in after] == list(range(s + 1, steps + 1))
    assert _one_final_model(run_dir, 3)


@pytest.mark.usefixtures("no_leftovers")
def test_below_min_workers_the_survivors_pause_snapshot_and_stop_and_a_resume_brings_the_lost_host_back(
    tmp_path, cleanup_keepers
):
    """Local SGD on 3 workers with --min-workers 3 loses host 2 after step 5. Hosts 0 and 1 go
    on to their next sync boundary (step 8), snapshot there (naming who was training), wait
    --join-timeout for a replacement, and stop with a line that says how to go on. The resume
    starts from step 8, not from step 4 before the fault: hosts 0 and 1 from their keepers, host
    2 as a joiner is admitted (a member's model and algorithm state, its own optimizer and data
    stream fresh); all three train to the end."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 3))
    job = ["run", "--workers", "3", "--algo", "localsgd", "--steps", "16", *JOB, "--run-dir", str(run_dir)]
    t0 = time.monotonic()
    proc = geotrain([*job, "--min-workers", "3", "--join-timeout", "2", "--chaos", "kill:step=5,rank=2"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    assert "paused after step 8, waiting up to 2 s for a replacement" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        "fewer than --min-workers 3" in proc.stderr and f"geotrain run --resume {run_dir}" in proc.stderr
    ), last
    for host in (0, 1):
        assert [r["step"] for r in _records(run_dir, host)] == list(range(1, 9))
        members = run_dir / "snapshots" / f"rank{host}" / "step00000008.members"
        assert json.loads(members.read_text()) == [0, 1]  # on disk too, beside the keepers' copy
    proc = geotrain(["run", "--resume", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    assert summary["resumed_from"]["step"] == 8
    assert summary["resumed_from"]["sources"] == ["keeper", "keeper", "member"]
    assert (summary["workers_start"], summary["workers"]) == (3, 3)
    for host in range(3):
        assert [r["step"] for r in _records(run_dir, host)][-8:] == list(range(9, 17))
    assert [r["step"] for r in _records(run_dir, 2)][:6] == [1, 2, 3, 4, 5, 9]  # lost after 5, back at 9
    # Tokens go on from the survivors' count at step 8 (not 8 steps of 3), then 8 steps of 3.
    records = _records(run_dir, 0)
    per_worker_step = records[0]["tokens"] // 3
    at_8 = records[7]["tokens"]
    assert at_8 < 8 * 3 * per_worker_step
    assert summary["tokens"] == at_8 + 8 * 3 * per_worker_step


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.long  # 21 s: the pause is the test above's, the admission test_a_replacement_is_admitted...'s
def test_below_min_workers_the_survivors_wait_at_the_boundary_for_the_replacement(tmp_path, cleanup_keepers):
    """The same loss with a replacement on its way (half a second, then its start-up): the
    survivors stop after step 8 until it is admitted there, and all three train on. Without the
    pause, two tiny workers would have run far past step 8 before it could join."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 3))
    job = ["run", "--workers", "3", "--algo", "localsgd", "--steps", "16", *JOB, "--run-dir", str(run_dir)]
    proc = geotrain(
        [*job, "--min-workers", "3", "--join-timeout", "60", "--chaos", "kill:step=5,rank=2,restart=0.5"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    (fault,) = summary["faults"]
    assert fault["rejoined_after_step"] == 8 and summary["workers"] == 3
    records = _records(run_dir, 0)
    assert [r["step"] for r in records] == list(range(1, 17))
    assert records[8]["wall_s"] - records[7]["wall_s"] > 1.0  # the wait for the replacement
    assert [r["step"] for r in _records(run_dir, 2)][-8:] == list(range(9, 17))


@pytest.mark.usefixtures("no_leftovers")
def test_a_joiner_receives_the_state_while_the_members_train_on_to_their_next_sync(tmp_path, cleanup_keepers):
    """A deferred admission: the survivors pause after step 8 for the replacement (--min-workers
    3), hand their state over without waiting for it to arrive, and train steps 9-16 while it
    does; the joiner skips those steps and meets them at the sync after step 16, its part of that
    average left out (it trained nothing since the state of step 8), so the run's tokens count
    two workers for those steps. On 1 Mbit/s links the hand-over (about 1.1 MB) outlasts the
    members' eight steps: they had trained them before the joiner came."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 3))
    net = ["--bandwidth", "1mbit"] if NETNS else ["--no-netem"]
    job = ["run", "--workers", "3", "--algo", "diloco", "--steps", "24", *BASE, "--H", "8", *net]
    job += ["--min-workers", "3", "--join-timeout", "60", "--chaos", "kill:step=5,rank=2,restart=0.5"]
    proc = geotrain([*job, "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    joined = summary["membership"][-1]
    assert joined["joined"] == [2] and joined["step"] == 8, joined
    assert joined["deferred"] == [2] and joined["deferred_until"] == 16
    members, joiner = _records(run_dir, 0), {r["step"]: r for r in _records(run_dir, 2)}
    assert [r["step"] for r in members] == list(range(1, 25)) and all(
        r.get("computed", True) for r in members
    )
    assert [s for s in range(9, 25) if joiner[s].get("computed", True)] == list(range(17, 25))
    by_step = {r["step"]: r for r in members}
    per_worker = by_step[17]["tokens"] - by_step[16]["tokens"]  # three workers computed step 17
    assert (by_step[16]["tokens"] - by_step[8]["tokens"]) * 3 == 8 * 2 * per_worker
    assert _one_final_model(run_dir, 3)
    if NETNS:  # the members' steps 9-15 were done before the joiner reached the sync of step 16
        assert by_step[15]["at"] < joiner[16]["at"] - 2.0, (by_step[15]["at"], joiner[16]["at"])


@pytest.mark.usefixtures("no_leftovers")
def test_with_every_state_holder_lost_before_the_joiner_is_admitted_all_restart_from_the_snapshots(
    tmp_path, cleanup_keepers
):
    """Local SGD on 3 workers, snapshots every 4 steps. Host 2 is lost after step 5 and its
    replacement starts half a second later; hosts 0 and 1 are lost after step 7, before it can
    be admitted (its start-up alone takes seconds). Nobody is left to hand it the state: it
    exits 5, and the launcher restarts every host from the newest snapshot all of them can
    restore (step 4), as a rollback does; they train to the end and end as one model. The code
    before ended the run with exit 1 ("the hosts finished but wrote no summary")."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 3))
    job = ["run", "--workers", "3", "--algo", "localsgd", "--steps", "12", *JOB, "--run-dir", str(run_dir)]
    chaos = "kill:step=5,rank=2,restart=0.5;kill:step=7,rank=0;kill:step=7,rank=1"
    proc = geotrain([*job, "--snapshot-every", "4", "--chaos", chaos])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no member holding the training state is left" in proc.stderr, proc.stderr[-3000:]
    summary = _summary(run_dir)
    assert summary["steps"] == 12 and summary["workers"] == 3
    faults = summary["faults"]
    assert len(faults) == 3, (faults, proc.stderr)  # (which record names which host varies)
    last = faults[-1]
    assert (last["at_step"], last["rollback_to"], last["steps_lost"]) == (7, 4, 3), last
    assert last["sources"] == ["keeper"] * 3
    for host in range(3):
        steps = [r["step"] for r in _records(run_dir, host)]
        assert steps[-8:] == list(range(5, 13)), (host, steps)
    assert _one_final_model(run_dir, 3)


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.long  # 40 s: two hosts 60x slower, so that the joiner waits while the sync fails
def test_a_joiner_admitted_into_a_redone_sync_takes_that_steps_snapshot_with_the_members(
    tmp_path, cleanup_keepers
):
    """With --redundancy ring a snapshot's agreement to ship is a collective. Host 2 is lost
    after step 9 and its replacement asks to join (at boundary 16); host 1 freezes after step
    15, so host 0's sync of step 16 fails with the joiner waiting. The joiner adopts host 0's
    state, the two redo the sync, and host 0 takes step 16's snapshot: the joiner must take it
    too. The code before started the joiner at step 17, and host 0 died in gloo after step 23
    ("terminate called after throwing an instance of 'gloo::EnforceNotMet'")."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 3))
    job = ["run", "--workers", "3", "--algo", "localsgd", "--steps", "24", *JOB, "--H", "8"]
    job += ["--run-dir", str(run_dir), "--snapshot-every", "8", "--redundancy", "ring"]
    job += ["--slow", "0:60;1:60", "--timeout-s", "60"]
    proc = geotrain([*job, "--chaos", "kill:step=9,rank=2,restart=0.1;stop:step=15,rank=1"], timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run_dir)
    admitted = [e for e in summary["membership"] if e.get("joined") == [2]]
    assert admitted and admitted[-1]["step"] == 16 and admitted[-1]["members"] == [0, 2], admitted
    assert len(summary["faults"]) == 2, summary["faults"]  # host 0 was not lost
    assert _one_final_model(run_dir, [0, 2])
