"""geotrain bench: time to target, the network model, the report, and the command end to end."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from geotrain.bench.curves import Curve, crossing, time_to_target, tokens_to_target
from geotrain.bench.matrix import BenchConfig, compute_share
from geotrain.bench.report import markdown_table, write_report
from geotrain.plan.cost import LinkModel
from geotrain.plan.network import NetworkModel
from geotrain.sync import ConfigError


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
    paths = write_report(results, tmp_path)
    for name in ("loss_vs_time", "loss_vs_tokens", "step_breakdown", "speedup_vs_ddp", "scale_check"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 5  # self-contained
    table = markdown_table(results)
    assert "| 2 | 20mbit | nosync | 0.100 |" in table and "not reached" in table
    assert "0.100*" in table  # ddp's exposed communication is inferred, and marked so
    assert "not reached" in page


@pytest.mark.usefixtures("no_leftovers")
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
            assert common is not None and row["final_val_loss"] <= group["common_loss"]
    ddp = group["algos"]["ddp"]
    assert ddp["time_to_target_s"] is not None and math.isclose(group["target_loss"], ddp["final_val_loss"])
    mtimes = {p: p.stat().st_mtime for p in out.glob("cells/*/*/summary.json")}
    assert len(mtimes) == 4

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert re.search(r"resuming: 4 of 4 cells already finished", again.stderr)
    assert {p: p.stat().st_mtime for p in out.glob("cells/*/*/summary.json")} == mtimes
