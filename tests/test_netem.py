"""The emulated cluster: shaping really limits throughput, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from geotrain.netem import cluster as netem
from geotrain.netem.cluster import EmulatedCluster, NetemUnavailable, geotrain_namespaces, sweep_stale
from helpers import transfers

pytestmark = pytest.mark.usefixtures("netns_or_skip", "no_leftovers")


def test_20mbit_link_takes_at_least_3_5_s_for_10_mb():
    with EmulatedCluster([20 * 10**6, 20 * 10**6]) as cluster:
        (elapsed,) = transfers(cluster, [(0, 1)], 10_000_000)
    # 80 Mbit at 20 Mbit/s is 4 s; TCP and tbf burst allow a little less.
    assert elapsed >= 3.5, f"10 MB crossed a 20 Mbit/s link in {elapsed:.2f} s: the link is not shaped"
    assert elapsed < 8.0


def test_a_message_after_a_pause_crosses_at_the_links_rate_not_in_a_free_burst():
    """150 KB on a fresh 100 Mbit/s link is 12 ms at the rate. The shaper's bucket used to hold
    10 ms of it (125 KB), which went at the veth's speed: it took about 2 ms, and a step's first
    messages crossed free."""
    with EmulatedCluster([10**8, 10**8]) as cluster:
        (elapsed,) = transfers(cluster, [(0, 1)], 150_000)
    at_rate = 150_000 * 8 / 10**8
    assert elapsed >= 0.75 * at_rate, f"150 KB took {elapsed * 1e3:.1f} ms; {at_rate * 1e3:.0f} at the rate"


def test_failed_setup_removes_what_it_made(monkeypatch):
    calls = {"n": 0}
    real = netem._tbf

    def failing_tbf(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # fail on the second host, after the first is fully made
            raise NetemUnavailable("injected failure")
        real(*args, **kwargs)

    monkeypatch.setattr(netem, "_tbf", failing_tbf)
    cluster = EmulatedCluster([10**8, 10**8])
    with pytest.raises(NetemUnavailable, match="injected"):
        cluster.up()
    assert not [ns for ns in geotrain_namespaces() if cluster.run_id in ns]
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert cluster.bridge not in links


def test_sweep_removes_runs_of_dead_launchers_and_nothing_else():
    # A launcher that makes a cluster and dies by SIGKILL, leaving everything behind.
    script = textwrap.dedent(
        """
        import os, signal, sys
        from geotrain.netem.cluster import EmulatedCluster
        c = EmulatedCluster([10**8, 10**8]).up()
        print(c.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    run_id = out.stdout.strip()
    assert run_id and len([ns for ns in geotrain_namespaces() if run_id in ns]) == 3  # 2 hosts, control
    subprocess.run(["ip", "netns", "add", "not-geotrain-test"], check=True)
    # A live run's state must be spared.
    live = EmulatedCluster([10**8]).up()
    try:
        removed = sweep_stale()
        assert f"geotrain-{run_id}-h0" in removed and f"gtb-{run_id}" in removed
        assert not [ns for ns in geotrain_namespaces() if run_id in ns]
        assert live.netns(0) in geotrain_namespaces()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "not-geotrain-test" in listed
    finally:
        live.down()
        subprocess.run(["ip", "netns", "del", "not-geotrain-test"])


def test_state_file_names_the_owner(tmp_path, monkeypatch):
    monkeypatch.setattr(netem, "STATE_DIR", tmp_path)
    with EmulatedCluster([10**8]) as cluster:
        state = json.loads((tmp_path / f"{cluster.run_id}.json").read_text())
        assert state["pid"] == os.getpid()
        assert state["namespaces"] == [cluster.netns(0), cluster.control_netns]
    assert not list(tmp_path.iterdir())
