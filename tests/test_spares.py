"""The backup pool: spares wait, started and ready, and take a lost host's place at once.

``geotrain run --spares K`` on the emulated cluster, ``geotrain join --spare`` on a real one
(FusionAI's backup providers). The coordinator hands each vacancy to the spare that registered
first and is still beating; the spare then joins as that host, like any replacement.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from geotrain.ft.membership import RunFinished, wait_for_vacancy
from geotrain.launch.coordinator import Pool, read_jsonl
from helpers import geotrain

TINY = ["--model", "tiny", "--batch-size", "4", "--no-progress", "--threads", "1"]


def _master():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def _register(store, label: int) -> int:
    i = int(store.add("spares", 1))
    store.set(f"spare/{i}", str(label))
    store.add(f"poolhb/{i}", 1)
    return i


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_pool_hands_each_vacancy_to_the_first_live_spare_and_takes_it_back_from_a_silent_one(tmp_path):
    store, clock = _master(), _Clock()
    pool = Pool(store, tmp_path, hosts=3, timeout_s=2.0, live=[0, 1, 2], clock=clock)
    first, second = _register(store, 7), _register(store, 8)
    pool.tick([0, 1, 2], attempt=0, run_over=False)
    assert not store.check([f"assign/{first}"]) and not (tmp_path / "spares.jsonl").exists()  # no vacancy
    # Host 1 is lost: the first spare gets its place (and a replacement is turned away), the
    # second waits on.
    pool.tick([0, 2], attempt=0, run_over=False)
    assert store.get(f"assign/{first}") == b"1" and not store.check([f"assign/{second}"])
    assert store.get("placed/1") == str(first).encode()
    (line,) = read_jsonl(tmp_path / "spares.jsonl")
    assert (line["spare"], line["label"], line["host"]) == (first, 7, 1)
    # It never claims the place and goes silent; the second beats on: the place goes to the
    # second, and the first's claim is closed (it can never go on as host 1).
    clock.now = 1.5
    store.add(f"poolhb/{second}", 1)
    pool.tick([0, 2], attempt=0, run_over=False)
    assert store.check([f"assign/{first}"])  # not silent for long enough yet
    clock.now = 3.0
    store.add(f"poolhb/{second}", 1)
    pool.tick([0, 2], attempt=0, run_over=False)
    assert store.get(f"assign/{second}") == b"1" and not store.check([f"assign/{first}"])
    assert store.compare_set(f"claim/{first}", "", "taken") == b"revoked"
    revoked = read_jsonl(tmp_path / "spares.jsonl")[1]
    assert (revoked["spare"], revoked["host"], revoked["claimed"]) == (first, 1, False) and revoked["revoked"]
    # The second claims it and then beats only as host 1 (its trainer's heartbeat): still alive.
    assert store.compare_set(f"claim/{second}", "", "taken") == b"taken"
    for t in (4.0, 5.5, 7.0):
        clock.now = t
        store.add("hb/0/1", 1)
        pool.tick([0, 2], attempt=0, run_over=False)
    assert store.get(f"assign/{second}") == b"1"
    # Admitted: an ordinary member, its place no longer reserved.
    pool.tick([0, 2, 1], attempt=0, run_over=False)
    assert not store.check(["placed/1"])
    # A restarted coordinator (a fresh store, the same control folder) issues new numbers after
    # the old ones, so a spare still waiting keeps its own.
    fresh = _master()
    Pool(fresh, tmp_path, hosts=3, timeout_s=2.0, live=[0, 2, 1], clock=clock)
    assert int(fresh.add("spares", 0)) == second
    # Host 2 lost while the run is over: nobody is placed. A host whose own replacement asked to
    # join is not vacant.
    third = _register(store, 9)
    pool.tick([0, 1], attempt=0, run_over=True)
    assert not store.check([f"assign/{third}"])
    store.set("join/2", "1")
    pool.tick([0, 1], attempt=0, run_over=False)
    assert not store.check([f"assign/{third}"])
    store.delete_key("join/2")
    pool.tick([0, 1], attempt=0, run_over=False)
    assert store.get(f"assign/{third}") == b"2"
    # The coordinator dies before the third is admitted: its successor places it again.
    fresh = _master()
    Pool(fresh, tmp_path, hosts=3, timeout_s=2.0, live=[0, 1], clock=clock)
    assert fresh.get(f"assign/{third}") == b"2" and fresh.get("placed/2") == str(third).encode()


def test_on_sites_a_vacancy_goes_to_a_spare_of_the_lost_hosts_site_first(tmp_path):
    """2 sites of 2 (hosts 0-3) and spares dealt over the sites (machine 4 in site 0, 5 in
    site 1): host 3 of site 1 is lost, and the spare of site 1 takes its place although the
    spare of site 0 registered first; with no spare of its site left, another site's serves."""
    store, clock = _master(), _Clock()
    pool = Pool(
        store, tmp_path, hosts=4, timeout_s=2.0, live=[0, 1, 2, 3], clock=clock, site_of=[0, 0, 1, 1, 0, 1]
    )
    near, far = _register(store, 4), _register(store, 5)
    pool.tick([0, 1, 2], attempt=0, run_over=False)
    assert store.get(f"assign/{far}") == b"3" and not store.check([f"assign/{near}"])
    pool.tick([0, 1, 2, 3], attempt=0, run_over=False)  # admitted
    pool.tick([0, 1, 3], attempt=0, run_over=False)  # host 2 of site 1 lost: site 0's spare serves
    assert store.get(f"assign/{near}") == b"2"
    assert [(x["label"], x["host"]) for x in read_jsonl(tmp_path / "spares.jsonl")] == [(5, 3), (4, 2)]
    # Two vacancies at once and one spare, of the higher host's site: it goes there, not to the
    # lower host of the other site.
    store = _master()
    pool = Pool(
        store, tmp_path / "b", hosts=4, timeout_s=2.0, live=[0, 1, 2, 3], clock=clock, site_of=[0, 0, 1, 1, 1]
    )
    (tmp_path / "b").mkdir()
    only = _register(store, 4)
    pool.tick([0, 2], attempt=0, run_over=False)
    assert store.get(f"assign/{only}") == b"3" and not store.check(["placed/1"])


def test_a_spare_waits_until_given_a_place_or_until_the_run_is_over():
    store = _master()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(wait_for_vacancy("127.0.0.1", store.port, 5)))
    waiter.start()
    deadline = time.monotonic() + 5
    while not store.check(["spare/1"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert store.get("spare/1") == b"5"
    before = store.add("poolhb/1", 0)
    time.sleep(0.6)
    assert store.add("poolhb/1", 0) > before  # it beats while it waits
    store.set("assign/1", "2")
    waiter.join(timeout=5)
    assert got == [2] and store.get("claim/1") == b"taken"
    # A place taken back before the spare claimed it: it waits on under a new number.
    got.clear()
    waiter = threading.Thread(target=lambda: got.append(wait_for_vacancy("127.0.0.1", store.port, 6)))
    store.set("assign/2", "0")
    store.set("claim/2", "revoked")
    waiter.start()
    deadline = time.monotonic() + 5
    while not store.check(["spare/3"]):
        assert time.monotonic() < deadline, "the spare did not register again"
        time.sleep(0.05)
    assert store.get("spare/3") == b"6" and not got
    store.set("assign/3", "0")
    waiter.join(timeout=5)
    assert got == [0]
    store.set("finished", "1")
    with pytest.raises(RunFinished, match="not needed"):
        wait_for_vacancy("127.0.0.1", store.port, -1)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TimeoutError, match="no coordinator answers"):
        wait_for_vacancy("127.0.0.1", port, -1, timeout_s=0.5)


def _records(run_dir: Path, host: int) -> list[dict]:
    lines = (run_dir / "metrics" / f"rank{host}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if not r.get("final")]


@pytest.mark.long  # (a spare placed end to end stays: test_topology.py, of another site)
@pytest.mark.usefixtures("no_leftovers")
def test_a_spare_takes_a_killed_hosts_place_at_the_next_boundary(tmp_path, cleanup_keepers):
    """3 hosts and 2 spares, local SGD with H=4; host 1 is killed after step 5. A spare (machine
    3 or 4, started with the others) is given host 1's place at once, is admitted where the
    survivors wait for it (step 8, --min-workers 3) with their state bitwise, and trains host 1's
    data to the end. The killed machine comes back a second later as a spare; the spares never
    needed leave when the run is over, which exits 0 with nothing left running."""
    run_dir = tmp_path / "run"
    cleanup_keepers.append((run_dir, 3))
    job = ["run", "--workers", "3", "--spares", "2", "--algo", "localsgd", "--H", "4", "--steps", "16"]
    job += [*TINY, "--no-netem", "--fault-timeout", "3", "--min-workers", "3", "--join-timeout", "60"]
    proc = geotrain([*job, "--run-dir", str(run_dir), "--chaos", "kill:step=5,rank=1,restart=1"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one of 2 spare(s) takes its place" in proc.stderr
    taken = re.search(r"spare host (\d) takes host 1's place", proc.stderr)
    assert taken and taken.group(1) in "34", proc.stderr[-3000:]
    assert "host 1 is back, as a spare" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["workers_start"], summary["workers"]) == (3, 3)
    (fault,) = summary["faults"]
    assert fault["rejoined_after_step"] == 8 and 0 < fault["rejoin_s"] < 30
    admitted = summary["membership"][-1]
    assert admitted["joined"] == [1] and admitted["param_digests"] == 1
    assert [r["step"] for r in _records(run_dir, 1)] == [1, 2, 3, 4, 5, *range(9, 17)]
    assert "takes the place of host 1" in (run_dir / "logs" / f"host{taken.group(1)}.log").read_text()
    hand_outs = read_jsonl(run_dir / "control" / "spares.jsonl")
    assert [(x["label"], x["host"]) for x in hand_outs] == [(int(taken.group(1)), 1)]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--spares", "1", "--on-failure", "rollback"], "--spares needs --on-failure continue"),
        (["--spares", "-1"], "--spares must be >= 0"),
    ],
)
def test_bad_spares_are_refused_with_one_line(extra, message):
    proc = geotrain(["run", "--workers", "2", "--no-netem", *TINY, "--steps", "2", *extra], timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
