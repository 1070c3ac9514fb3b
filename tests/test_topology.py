"""Sites: the topology spec, the emulated LANs and shared WAN uplinks, and a run across sites."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import textwrap

import pytest

from geotrain.launch.coordinator import read_jsonl
from geotrain.netem import cluster as netem
from geotrain.netem.cluster import EmulatedCluster, geotrain_namespaces, sweep_stale
from geotrain.netem.links import LinkSpecError
from geotrain.netem.topology import Topology, parse_topology
from helpers import geotrain, refused, transfers


def test_a_topology_spec_gives_sites_lan_and_wan_rates():
    even = parse_topology("2x2,lan=1gbit,wan=20mbit")
    assert even == Topology((2, 2), 10**9, (20 * 10**6, 20 * 10**6))
    assert even.workers == 4 and even.host_sites() == [0, 0, 1, 1] and even.host_rates() == [10**9] * 4
    assert even.describe() == "2 sites (2+2), LAN 1gbit, WAN 20mbit"
    uneven = parse_topology("3+1,wan=20mbit+5mbit")  # lan defaults to 1 Gbit/s
    assert uneven.sites == (3, 1) and uneven.wan_bps == (20 * 10**6, 5 * 10**6) and uneven.lan_bps == 10**9
    assert uneven.host_sites() == [0, 0, 0, 1]
    assert uneven.describe() == "2 sites (3+1), LAN 1gbit, WAN 20mbit+5mbit"
    assert parse_topology("3x1,lan=100mbit,wan=10mbit").sites == (1, 1, 1)


BAD_SPECS = [
    ("", "--topology takes SITES,lan=RATE,wan=RATE"),
    ("2x2", "the WAN rate (wan=RATE) is missing"),
    ("4,wan=10mbit", "SITES as 2x2 (2 sites of 2 hosts) or 3+1"),
    ("1x4,wan=10mbit", "a topology has 2 to 16 sites, got 1"),
    ("2+0,wan=10mbit", "every site needs at least one host, got 2+0"),
    ("2x2,wan=10mbit+5mbit+1mbit", "give one WAN rate, or one per site (2), joined by '+'; got 3"),
    ("2x2,wan=10mbps", "bandwidth '10mbps' is not understood"),
    ("2x2,wan=10mbit,lat=5ms", "'lat=5ms' is not lan=RATE or wan=RATE"),
    ("2x2,wan=10mbit,wan=5mbit", "gives wan= twice"),
    ("2x2,lan=10mbit,wan=100mbit", "is faster than its hosts' LAN links (10mbit)"),
    ("2x2,lan=100mbit,wan=1gbit+5mbit", "a site's WAN uplink (1gbit) is faster than its hosts' LAN"),
]


@pytest.mark.parametrize("spec,message", BAD_SPECS, ids=[s or "empty" for s, _ in BAD_SPECS])
def test_a_bad_topology_spec_is_refused_with_what_to_change(spec, message):
    with pytest.raises(LinkSpecError) as e:
        parse_topology(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_the_link_probe_meets_every_pair_once_in_rounds_of_disjoint_pairs(n):
    from geotrain.comm.linkmatrix import rounds

    schedule = rounds(n)
    assert len(schedule) == n - 1 + n % 2
    met = [pair for pairs in schedule for pair in pairs]
    assert sorted(met) == [(i, j) for i in range(n) for j in range(i + 1, n)]
    for pairs in schedule:
        ranks = [r for pair in pairs for r in pair]
        assert len(ranks) == len(set(ranks))


def test_sites_are_the_hosts_joined_by_links_much_faster_than_the_slowest():
    from geotrain.comm.linkmatrix import sites_from

    inf = float("inf")
    two_sites = [[inf, 100, 1, 1], [100, inf, 1.2, 1], [1, 1.2, inf, 90], [1, 1, 90, inf]]
    assert sites_from(two_sites) == [0, 0, 1, 1]
    interleaved = [[inf, 1, 50, 1], [1, inf, 1, 50], [50, 1, inf, 1], [1, 50, 1, inf]]
    assert sites_from(interleaved) == [0, 1, 0, 1]
    assert sites_from([[inf, 3, 1], [3, inf, 2], [1, 2, inf]]) == [0, 0, 0]  # no gap of 8x
    a_lone_host = [[inf, 100, 2], [100, inf, 1], [2, 1, inf]]
    assert sites_from(a_lone_host) == [0, 0, 1]
    assert sites_from([[inf]]) == [0]
    # a uniform cluster where one pair measured 5x faster (noise) stays one site
    noisy = [[inf if i == j else 1.0 for j in range(4)] for i in range(4)]
    noisy[0][1] = noisy[1][0] = 5.0
    assert sites_from(noisy) == [0, 0, 0, 0]


@pytest.mark.parametrize("joiners, members", [([3], [0, 1, 2]), ([1, 4], [0, 2, 3]), ([2, 3, 4], [0, 1])])
def test_the_joiner_probe_meets_each_member_once_in_rounds_of_disjoint_pairs(joiners, members):
    from geotrain.comm.linkmatrix import joiner_rounds

    schedule = joiner_rounds(joiners, members)
    met = sorted(pair for pairs in schedule for pair in pairs)
    assert met == sorted(tuple(sorted((j, m))) for j in joiners for m in members)
    for pairs in schedule:
        ranks = [r for pair in pairs for r in pair]
        assert len(ranks) == len(set(ranks))


def test_a_joiner_takes_the_site_it_reaches_much_faster_than_the_others_else_its_own():
    from geotrain.comm.linkmatrix import site_of_joiner

    # to members of sites 0, 0, 1: fast to one of site 0 (the best link of a site counts)
    assert site_of_joiner([100.0, 3.0, 2.0], [0, 0, 1]) == (0, {0: 100.0, 1: 2.0})
    assert site_of_joiner([2.0, 2.5, 90.0], [0, 0, 1])[0] == 1
    assert site_of_joiner([2.0, 2.5, 15.0], [0, 0, 1])[0] is None  # 6x: no site is clearly its
    assert site_of_joiner([5.0, 5.0, 5.0], [0, 1, 2])[0] is None  # slow to all: a site of its own
    assert site_of_joiner([50.0, 50.0], [0, 0])[0] is None  # one site: nothing to tell apart


@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
def test_a_sites_cross_site_transfers_share_its_uplink_and_its_hosts_talk_at_lan_speed():
    """2 sites of 2 hosts, 8 Mbit/s uplinks: 1 MB from each host of site 0 to site 1, at once,
    takes as long as 2 MB through one 8 Mbit/s link (2 s); 10 MB inside a site at 1 Gbit/s, a
    tenth of a second; the uplinks' counters hold what crossed them."""
    topo = parse_topology("2x2,lan=1gbit,wan=8mbit")
    with EmulatedCluster(topo.host_rates(), sites=topo.host_sites(), wan_bps=list(topo.wan_bps)) as cluster:
        run_id = cluster.run_id
        (alone,) = transfers(cluster, [(0, 2)], 10**6)
        shared = transfers(cluster, [(0, 2), (1, 3)], 10**6)
        (inside,) = transfers(cluster, [(0, 1)], 10**7)
        traffic = cluster.traffic()
    assert 0.85 < alone < 1.6, alone  # 8 Mbit at 8 Mbit/s: 1 s
    assert max(shared) > 1.7, shared  # 16 Mbit through the one uplink
    assert inside < 0.6, inside  # 80 Mbit at 1 Gbit/s: 0.08 s
    assert 3_000_000 <= traffic["wan_sent"][0] < 3_300_000  # 3 MB and TCP's headers
    assert traffic["wan_sent"][1] < 200_000  # acknowledgements only
    assert traffic["host_sent"][0] > 12_000_000 and traffic["host_sent"][2] < 200_000
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert run_id not in links and not [ns for ns in geotrain_namespaces() if run_id in ns]


@pytest.mark.parametrize("state", ["intact", "truncated"])
@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
def test_the_sweep_removes_a_dead_launchers_sites_bridges_and_uplinks(state):
    """A launcher SIGKILLed with its sites up leaves namespaces, site bridges and uplinks; the
    sweep removes them all, also where its state file was cut short by the kill."""
    script = textwrap.dedent(
        """
        import os, signal
        from geotrain.netem.cluster import EmulatedCluster
        c = EmulatedCluster([10**8] * 3, sites=[0, 0, 1], wan_bps=[10**7, 10**7]).up()
        print(c.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    run_id = out.stdout.strip()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert run_id and links.count(run_id) >= 9  # 2 site bridges, 2 uplink pairs, the core, 4 veths
    if state == "truncated":
        path = netem.STATE_DIR / f"{run_id}.json"
        path.write_text(path.read_text()[:20])
    removed = sweep_stale()
    assert f"gts{run_id}-0" in removed and f"gtu{run_id}-1" in removed
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert run_id not in links and not [ns for ns in geotrain_namespaces() if run_id in ns]


def _run_across_sites(tmp_path, name, *extra):
    run = tmp_path / name
    # fp32 (diloco's default is int4, whose all-to-all runs flat): the ring's and the two levels' bytes
    cmd = [
        "run",
        "--topology",
        "2x2,lan=1gbit,wan=50mbit",
        "--algo",
        "diloco",
        "--H",
        "4",
        "--compress",
        "none",
    ]
    cmd += ["--model", "tiny", "--batch-size", "4", "--steps", "8", "--no-progress", "--threads", "1"]
    proc = geotrain([*cmd, *extra, "--run-dir", str(run)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    logs = sorted((run / "metrics").glob("rank*.jsonl"))
    finals = [json.loads(f.read_text().splitlines()[-1]) for f in logs]
    assert len(finals) == 4
    assert len({f["param_digest"] for f in finals}) == 1  # the replicas ended as one model
    return proc, summary


@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
def test_a_run_across_two_sites_reports_its_lan_and_wan_bytes(tmp_path):
    """diloco over 2 sites of 2 hosts: its averages cross the WAN, and the summary says how much."""
    _flat_across_sites(tmp_path)


def _flat_across_sites(tmp_path) -> dict:
    flat, summary = _run_across_sites(tmp_path, "flat")
    assert summary["workers"] == 4 and summary["link"] == "2 sites (2+2), LAN 1gbit, WAN 50mbit"
    # A ring of 4 across 2 sites crosses twice (hops 1->2 and 3->0), each hop carrying what one
    # worker sends: the WAN carries 2 x a worker's bytes and the LANs the other 2 (measured 2.15
    # and 1.95 with headers, heartbeats and the end-of-run average).
    assert 1.8 < summary["wan_bytes_per_step"] / summary["sent_bytes_per_step"] < 2.8
    assert 1.6 < summary["lan_bytes_per_step"] / summary["sent_bytes_per_step"] < 2.6
    assert len(summary["wan_bytes_per_step_by_site"]) == 2
    assert "inside the sites" in flat.stdout and "across their WAN uplinks (site 0: " in flat.stdout
    saved = json.loads((tmp_path / "flat" / "config.json").read_text())
    assert saved["topology"] == "2x2,lan=1gbit,wan=50mbit" and saved["workers"] == 4
    assert saved["train"]["sites"] == "0,0,1,1"
    return summary


@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
@pytest.mark.long  # 37 s; CI has the bytes of the two levels across sites in test_hierarchy_gloo.py
def test_across_two_sites_two_levels_send_less_across(tmp_path):
    """With --hierarchy sites each average crosses as two stripes of half the model, one per
    member, instead of a ring's 1.5 model through each crossing."""
    summary = _flat_across_sites(tmp_path)
    _, two = _run_across_sites(tmp_path, "two-level", "--hierarchy", "sites")
    assert two["sites"] == [0, 0, 1, 1] and summary["sites"] is None
    # On the wire (headers, heartbeats and all): the model crosses as 1 x instead of 1.5 x
    # (measured 0.67).
    assert 0.55 < two["wan_bytes_per_step"] / summary["wan_bytes_per_step"] < 0.75
    assert two["lan_bytes_per_step"] > summary["lan_bytes_per_step"]


@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
@pytest.mark.long  # 60 s; CI has the two-level gather's order and bytes in test_hierarchy_gloo.py
def test_across_two_sites_sparselocos_gather_in_two_levels_sends_less_across(tmp_path):
    """SparseLoCo's messages, all-gathered: flat, a ring of 4 pushes 3 messages through each
    crossing; in two levels each crosses once, carried by its own host (2 per uplink). The
    replicas end as one model either way."""
    sparse = ["--algo", "sparseloco", "--H", "4", "--chunk", "256", "--k", "64"]
    runs = {}
    for name, extra in (("flat", []), ("two-level", ["--hierarchy", "sites"])):
        cmd = ["run", "--topology", "2x2,lan=1gbit,wan=50mbit", *sparse, *extra]
        cmd += ["--model", "tiny", "--batch-size", "4", "--steps", "8", "--no-progress", "--threads", "1"]
        proc = geotrain([*cmd, "--run-dir", str(tmp_path / name)], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
        logs = sorted((tmp_path / name / "metrics").glob("rank*.jsonl"))
        assert len({json.loads(f.read_text().splitlines()[-1])["param_digest"] for f in logs}) == 1
    # On the wire, headers and heartbeats and all (2 / 3 of the messages' bytes, and less)
    assert 0.5 < runs["two-level"]["wan_bytes_per_step"] / runs["flat"]["wan_bytes_per_step"] < 0.8


@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
def test_two_levels_go_on_after_a_site_loses_a_host(tmp_path, cleanup_keepers):
    """PyTorch DDP over 2 sites of 2 with --hierarchy auto: the pairs inside a site measure far
    faster than any across, so the sites come out as the topology's, and DDP's buckets go through
    the two-level all-reduce. Host 3 is killed after step 4: the survivors regroup, remake the two
    levels for sites of 2 and 1 (the lone host carries both stripes of its site), and train to
    the end as one model."""
    run = tmp_path / "run"
    cleanup_keepers.append((run, 4))
    cmd = ["run", "--topology", "2x2,lan=1gbit,wan=50mbit", "--hierarchy", "auto"]
    cmd += ["--algo", "ddp", "--model", "tiny", "--batch-size", "4", "--steps", "10", "--no-progress"]
    cmd += ["--threads", "1", "--fault-timeout", "3", "--chaos", "kill:step=4,rank=3", "--run-dir", str(run)]
    proc = geotrain(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["workers_start"], summary["workers"]) == (4, 3)
    assert summary["sites"] == [0, 0, 1, 1]
    said = proc.stderr + proc.stdout
    assert "links measured in" in said and "sites [0, 0, 1, 1]" in said
    assert [e["members"] for e in summary["membership"]] == [[0, 1, 2]]
    logs = [(run / "metrics" / f"rank{h}.jsonl").read_text().splitlines() for h in (0, 1, 2)]
    finals = [json.loads(lines[-1]) for lines in logs]
    assert {f["step"] for f in finals} == {10} and len({f["param_digest"] for f in finals}) == 1


@pytest.mark.usefixtures("netns_or_skip", "no_leftovers")
# `-m long` for auto: the sites it measures are in CI in the test above
@pytest.mark.parametrize("hierarchy", ["sites", pytest.param("auto", marks=pytest.mark.long)])
def test_on_sites_a_spare_of_another_site_takes_a_place_in_its_own_machines_site(
    tmp_path, cleanup_keepers, hierarchy
):
    """2 sites of 2 and 1 spare, dealt to site 0 (machine 4, behind site 0's uplink). Host 3 of
    site 1 is killed after step 5: machine 4 takes its place, is admitted at step 8
    (--min-workers 4) and the four train to the end as one model. With --site-H the new host 3
    averages with site 0, where its machine is, not with site 1, where its host number was:
    the coordinator says so under --hierarchy sites; under auto the members measure the
    joiner's links. (The same-site preference is pinned in test_spares.py.)"""
    run = tmp_path / "run"
    cleanup_keepers.append((run, 4))
    cmd = ["run", "--topology", "2x2,lan=1gbit,wan=50mbit", "--spares", "1", "--algo", "localsgd"]
    cmd += ["--H", "4", "--steps", "12", "--model", "tiny", "--batch-size", "4", "--no-progress"]
    cmd += ["--threads", "1", "--hierarchy", hierarchy, "--site-H", "2"]
    cmd += ["--fault-timeout", "3", "--min-workers", "4", "--join-timeout", "60"]
    cmd += ["--chaos", "kill:step=5,rank=3", "--run-dir", str(run)]
    proc = geotrain(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spare host 4 takes host 3's place" in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["workers_start"], summary["workers"]) == (4, 4)
    assert summary["membership"][-1]["joined"] == [3] and summary["faults"][0]["rejoined_after_step"] == 8
    assert summary["sites"] == [0, 0, 1, 0]
    (joined,) = [e for e in read_jsonl(run / "control" / "epochs.jsonl") if e.get("joined")]
    assert joined["site"] == 0
    if hierarchy == "auto":
        assert "sites [0, 0, 1, 1]" in proc.stderr and "host 3 (" in proc.stderr, proc.stderr[-3000:]
        assert re.search(r"host 3 \(\d+ Mbit/s to site 0, \d+ Mbit/s to site 1\) joins site 0", proc.stderr)
    finals = [json.loads((run / "metrics" / f"rank{h}.jsonl").read_text().splitlines()[-1]) for h in range(4)]
    assert {f["step"] for f in finals} == {12} and len({f["param_digest"] for f in finals}) == 1


def _median_step(run, host):
    """The median step time (a shared machine's hiccups move the mean), the first step left out."""
    lines = (run / "metrics" / f"rank{host}.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if not json.loads(x).get("final")][1:]
    return statistics.median(r["step_s"] for r in steps)


@pytest.mark.usefixtures("no_leftovers")
def test_a_straggler_computes_factor_times_slower(tmp_path):
    """--slow 1:3 on 2 workers: without communication host 1's steps take 3x host 0's or more (the
    sleep counts three forwards as a step's compute, which overstates ``tiny``'s: 4.1-4.2x
    measured at batch 32; at batch 8, 9-11 ms steps, 4.4-5.3x, and the test flaked)."""
    base = ["run", "--workers", "2", "--no-netem", "--model", "tiny", "--batch-size", "32"]
    base += ["--steps", "10", "--no-progress", "--threads", "1", "--slow", "1:3"]
    run = tmp_path / "run"
    cmd = [*base, "--algo", "nosync", "--run-dir", str(run)]
    proc = geotrain(cmd, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Steps also hold work that is not compute (the next batch, metrics), which is not slowed.
    fast, slow = _median_step(run, 0), _median_step(run, 1)
    assert 2.0 < slow / fast < 5.5, (fast, slow)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stragglers"] == {"1": 3.0} and summary["sent_bytes_per_step"] == 0  # nosync


CLI_ERRORS = [
    (["--topology", "2x2,wan=1mbit", "--workers", "3"], "has 4 hosts, not --workers 3; leave --workers out"),
    (["--topology", "2x2,wan=1mbit", "--bandwidth", "5mbit"], "drop --bandwidth"),
    (["--topology", "2x2,wan=1mbit", "--no-netem"], "drop --no-netem"),
    (["--topology", "2x2,wan=1mbit", "--sites", "0,1,0,1"], "drop --sites"),
    (["--hierarchy", "sites"], "--hierarchy sites needs the site of each host: run with --topology"),
    (["--slow", "1:1"], "--slow takes HOST:FACTOR, ';'-separated, each host once, a factor above 1"),
    (["--hierarchy", "auto", "--sites", "0,0,1,1"], "--hierarchy auto measures the sites itself"),
    (["--workers", "2", "--slow", "5:2"], "--slow names host 5; the run's hosts are 0 to 1"),
]


@pytest.mark.parametrize("args,message", CLI_ERRORS, ids=[" ".join(a[2:]) or a[1] for a, _ in CLI_ERRORS])
def test_the_cli_refuses_topologies_it_cannot_honour_in_one_line(tmp_path, args, message):
    cmd = ["run", *args, "--model", "tiny", "--steps", "2", "--run-dir", str(tmp_path / "r")]
    assert message in refused(cmd)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"hierarchy": "tree"}, "unknown --hierarchy 'tree'; accepted: off, sites, auto"),
        ({"sites": "0,x"}, "--sites takes a site number >= 0 per host"),
        ({"sites": "0,-1"}, "--sites takes a site number >= 0 per host"),
        ({"slow": "1"}, "--slow takes HOST:FACTOR"),
        ({"slow": "1:2;1:3"}, "each host once"),
        ({"slow": "1:101"}, "at most 100"),
    ],
)
def test_bad_sites_and_stragglers_are_refused_with_what_to_change(options, message):
    from geotrain.sync import ConfigError
    from geotrain.train import TrainConfig

    with pytest.raises(ConfigError) as e:
        TrainConfig(**options)
    assert message in str(e.value)
    assert TrainConfig(slow="1:3;0:1.5").slow_factors() == {1: 3.0, 0: 1.5}
    assert TrainConfig(sites="0,0,1").site_of_host() == [0, 0, 1] and TrainConfig().site_of_host() is None


PROFILE_REFUSES = [["--hierarchy", "auto"], ["--slow", "1:2"], ["--topology", "2x2,wan=1mbit"]]


@pytest.mark.parametrize("flag", PROFILE_REFUSES)
def test_geotrain_profile_refuses_what_it_would_not_measure(tmp_path, flag):
    line = refused(["profile", *flag, "--model", "tiny", "--out", str(tmp_path / "p.json")])
    assert line.startswith("geotrain profile: error:") and not (tmp_path / "p.json").exists()
