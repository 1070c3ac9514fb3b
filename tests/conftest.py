import subprocess
import time
from pathlib import Path

import pytest

from geotrain.netem.cluster import geotrain_namespaces, netem_unavailable_reason


@pytest.fixture
def netns_or_skip():
    reason = netem_unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    # A probe: some containers are root but may not create namespaces.
    probe = subprocess.run(["ip", "netns", "add", "geotrain-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces cannot be made here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", "geotrain-probe"], capture_output=True)


def _geotrain_processes() -> set[int]:
    """Trainers and coordinators running now (keepers outlive failed runs by design)."""
    import os

    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # `python -m MODULE`: not a forkserver whose preload list names geotrain.train (the
        # gloo tests' workers, which tests/suite.py runs beside these)
        modules = {after for before, after in zip(args, args[1:], strict=False) if before == b"-m"}
        if modules & {b"geotrain.train", b"geotrain.launch.coordinator"}:
            found.add(int(pid))
    return found


def _geotrain_links() -> set[str]:
    """Bridges and veths of emulated clusters in the root namespace (gtb-, gts, gtu, gtw, gtv)."""
    if netem_unavailable_reason():
        return set()
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}
    return {n for n in names if n[:3] in ("gtb", "gts", "gtu", "gtw", "gtv")}


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves geotrain namespaces, links, trainers or coordinators behind."""
    before = set(geotrain_namespaces())
    links = _geotrain_links()
    procs = _geotrain_processes()
    yield
    left = set(geotrain_namespaces()) - before
    assert not left, f"namespaces left behind: {left}"
    left_links = _geotrain_links() - links
    assert not left_links, f"links left behind: {left_links}"
    # A trainer the launcher has already stopped may still be exiting on a loaded machine (seen
    # once in `make test`, never alone): give it seconds, so that only one that stays fails.
    deadline = time.monotonic() + 10
    stray = _geotrain_processes() - procs
    while stray and time.monotonic() < deadline:
        time.sleep(0.2)
        stray = _geotrain_processes() - procs
    assert not stray, f"processes left behind: {stray}"


@pytest.fixture
def cleanup_keepers():
    """Run directories (and their host counts) whose lingering keepers the test stops at the end."""
    from geotrain.launch.keepers import stop_keepers

    run_dirs: list[tuple[Path, int]] = []
    yield run_dirs
    for run_dir, n in run_dirs:
        stop_keepers(run_dir, n)


@pytest.fixture
def keeper(tmp_path):
    """A keeper serving in a thread of this process (disk under ``tmp_path/snaps``): its client
    and that folder."""
    import contextlib
    import threading

    from geotrain.ft.keeper import KeeperClient, KeeperError, serve, wait_ready

    sock = tmp_path / "k.sock"
    t = threading.Thread(target=serve, args=(sock, tmp_path / "snaps", 0.0), daemon=True)
    t.start()
    wait_ready(sock)
    client = KeeperClient(sock)
    yield client, tmp_path / "snaps"
    with contextlib.suppress(KeeperError):  # a test may have stopped it already
        client.stop()
    t.join(timeout=10)
