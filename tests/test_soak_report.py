"""The soak's picture and report, from run directories written the way trainers write them."""

from __future__ import annotations

import json
from pathlib import Path

from geotrain.bench.soak_report import run_curves, write_soak_report

T0 = 1_800_000_000.0  # wall clock of the first step's start


def _write(run_dir: Path, host: int, steps: range, start: float, workers: int) -> None:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics" / f"rank{host}.jsonl").open("a") as f:
        for s in steps:
            r = {"step": s, "tokens": 100 * s, "at": start + s, "step_s": 1.0, "workers": workers}
            if s % 2 == 0:
                r["val_loss"] = 10.0 / s
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps({"step": steps[-1], "final": True, "val_loss": 1.0}) + "\n")


def test_curves_merge_every_host_by_wall_clock(tmp_path):
    """Host 1 is lost after step 3; its replacement writes steps 6-8 to the same file from its
    own clock: every point lands at its wall-clock time from the first step."""
    run = tmp_path / "faulty"
    _write(run, 0, range(1, 9), T0, 2)
    _write(run, 1, range(1, 4), T0, 2)
    _write(run, 1, range(6, 9), T0, 2)
    curves = run_curves(run)
    assert curves["t0"] == [T0]
    assert curves["val_time"] == [(s, 10.0 / s) for s in (2, 4, 6, 8)]  # one point per step
    assert curves["val_tokens"] == [(100 * s, 10.0 / s) for s in (2, 4, 6, 8)]
    assert [t for t, _ in curves["workers"]] == [float(s) for s in range(1, 9)]


def test_the_report_is_one_page_with_the_picture_and_the_tables(tmp_path):
    for name in ("undisturbed", "faulty"):
        for host in (0, 1):
            _write(tmp_path / name, host, range(1, 9), T0, 2)
    result = {
        "job": {"workers": 2, "model": "tiny", "bandwidth": "100mbit", "algo": "diloco", "H": 4,
                "steps": 8, "on_failure": "continue"},
        "chaos": "kill:every=60s,restart=5",
        "faults": [{"rank": 1, "detected_at": T0 + 3.5}],
        "membership": [{"joined": [], "at": T0 + 4}, {"joined": [1], "at": T0 + 6}],
    }  # fmt: skip
    paths = write_soak_report(tmp_path, result, ["| fault | kind |\n|---|---|\n| 1 | kill |"])
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["html"].read_text()
    assert 'src="data:image/png;base64,' in page and "<th>fault</th>" in page and "<td>kill</td>" in page
    assert "kill:every=60s,restart=5" in page


def test_an_admission_counts_the_members_digests_of_their_parameters_and_of_what_they_hold_equal(tmp_path):
    """SparseLoCo under overlap: at an admission each member's parameters are its own (a period
    starts from the anchor moved by its own message) while the anchor is every member's. The
    merged epoch counts both, and the soak's comparison reads what the algorithm holds equal."""
    from geotrain.bench.soak import compare
    from geotrain.launch.faults import regroup_events

    control = tmp_path / "control"
    control.mkdir()
    base = {"members": [0, 1, 2], "behind": [2], "step": 20, "at": 1.0, "handed_over_bytes": 10}
    for host, params, shared in ((0, "a", "s"), (1, "b", "s"), (2, "a", "s")):
        digests = {"param_digest": params, "shared_digest": shared}
        view = {**base, "epoch": 2, "joined": [2], "host": host, **digests}
        older = {**base, "epoch": 1, "joined": [], "host": host}
        (control / f"regroups-h{host}.jsonl").write_text(json.dumps(older) + "\n" + json.dumps(view) + "\n")
    first, admitted = regroup_events(control)
    assert "param_digests" not in first and "shared_digests" not in first
    assert admitted["param_digests"] == 2 and admitted["shared_digests"] == 1
    run = {"elapsed_s": 10.0, "tokens": 100, "final_val_loss": 2.0}
    (tmp_path / "metrics").mkdir()
    curve = [{"tokens": t, "val_loss": v} for t, v in ((0, 3.0), (200, 1.0))]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    cmp = compare({**run, "final_val_loss": 2.0}, {**run, "membership": [first, admitted]}, tmp_path)
    assert cmp["admissions_with_members_bitwise_equal"] == 0
    assert cmp["admissions_with_shared_state_bitwise_equal"] == 1


def test_a_deferred_admission_costs_the_members_their_regroup_and_their_wait_at_the_meeting(tmp_path):
    """Admitted deferred, the joiner meets the members at their next sync, where they wait for
    what its hand-over took past their period: each member records that wait beside its regroup
    records, the merged epoch takes the slowest member's, and the soak's cost of an admission
    adds it to the regroup's (which alone read 2.87 s a CO2 admission at 2 Mbit/s, where the
    members then waited about 6 s more at the meeting)."""
    from geotrain.bench.soak import compare, comparison_table
    from geotrain.launch.faults import regroup_events

    control = tmp_path / "control"
    control.mkdir()
    base = {"members": [0, 1, 2], "behind": [2], "step": 20, "at": 1.0, "epoch": 2, "joined": [2]}
    for host, regroup_s in ((0, 0.5), (1, 0.75), (2, 4.0)):  # (the joiner's own: its hand-over)
        view = {**base, "host": host, "deferred": [2], "regroup_s": regroup_s}
        (control / f"regroups-h{host}.jsonl").write_text(json.dumps(view) + "\n")
    for host, wait in ((0, 3.0), (1, 3.25)):
        wait_line = json.dumps({"epoch": 2, "meeting_wait_s": wait}) + "\n"
        (control / f"meetings-h{host}.jsonl").write_text(wait_line)
    (admitted,) = regroup_events(control)
    assert admitted["regroup_s"] == 0.75 and admitted["meeting_wait_s"] == 3.25
    run = {"elapsed_s": 10.0, "tokens": 100, "final_val_loss": 2.0, "workers_start": 3, "workers": 3}
    (tmp_path / "metrics").mkdir()
    curve = [{"tokens": t, "val_loss": v} for t, v in ((0, 3.0), (200, 1.0))]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    faulty = {**run, "membership": [admitted]}
    cmp = compare(run, faulty, tmp_path)
    assert cmp["admission_s_mean"] == 4.0 and cmp["admissions_deferred"] == 1
    assert "1 of them deferred" in comparison_table(run, faulty, cmp)


def test_an_algorithm_that_holds_nothing_equal_is_reported_so_not_as_unequal(tmp_path):
    """DreamDDP (without a codec) averages each layer at its own iteration: at no boundary are
    the replicas equal. Its members record no shared digest (None), the merged epoch says so, and
    the soak's line says the algorithm holds nothing equal instead of "equal at 0 of 1"."""
    from geotrain.bench.soak import compare, comparison_table
    from geotrain.launch.faults import regroup_events

    control = tmp_path / "control"
    control.mkdir()
    base = {"members": [0, 1], "behind": [1], "step": 20, "at": 1.0, "epoch": 2, "joined": [1]}
    for host, params in ((0, "a"), (1, "a")):
        view = {**base, "host": host, "param_digest": params, "shared_digest": None}
        (control / f"regroups-h{host}.jsonl").write_text(json.dumps(view) + "\n")
    (admitted,) = regroup_events(control)
    assert admitted["param_digests"] == 1 and admitted["shared_digests"] is None
    run = {"elapsed_s": 10.0, "tokens": 100, "final_val_loss": 2.0, "workers_start": 2, "workers": 2}
    (tmp_path / "metrics").mkdir()
    curve = [{"tokens": t, "val_loss": v} for t, v in ((0, 3.0), (200, 1.0))]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    faulty = {**run, "membership": [{**admitted, "regroup_s": 1.5}]}
    cmp = compare(run, faulty, tmp_path)
    assert cmp["admissions_with_shared_state_bitwise_equal"] is None
    assert "holds nothing bitwise equal at a sync" in comparison_table(run, faulty, cmp)
