import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from geotrain.netem.cluster import NS_PREFIX, STATE_DIR, geotrain_namespaces, netem_unavailable_reason

# The leftover check looks only at what this pytest session made, not at another geotrain run or
# test session on the machine (a benchmark beside the suite). Its processes carry this variable
# (the launcher runs in the test's process, and every host inherits its environment); its
# clusters' state files name its pid.
SESSION_ENV = "GEOTRAIN_TEST_SESSION"
os.environ[SESSION_ENV] = str(os.getpid())


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
    """This session's trainers and coordinators running now (keepers outlive failed runs by
    design)."""
    ours = str(os.getpid()).encode()
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            # `python -m MODULE`: not a forkserver whose preload list names geotrain.train (the
            # gloo tests' workers, which tests/suite.py runs beside these)
            modules = {after for before, after in zip(args, args[1:], strict=False) if before == b"-m"}
            if not modules & {b"geotrain.train", b"geotrain.launch.coordinator"}:
                continue
            if _session_of(int(pid)) == ours:
                found.add(int(pid))
        except OSError:  # gone meanwhile
            continue
    return found


def _session_of(pid: int) -> bytes | None:
    """The test session whose environment process ``pid`` carries, or None."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((e.split(b"=", 1)[1] for e in env if e.startswith(f"{SESSION_ENV}=".encode())), None)


def _ours_or_orphan(run_id: str) -> bool:
    """A cluster this session made (its launcher in this process or a child of it), or one no
    live launcher owns."""
    try:
        pid = json.loads((STATE_DIR / f"{run_id}.json").read_text())["pid"]
    except FileNotFoundError:  # no state: an orphan (a launcher writes it before it builds)
        return True
    except (OSError, ValueError, KeyError):  # half written: a launcher is making it now
        return False
    if pid == os.getpid() or not Path(f"/proc/{pid}").exists():
        return True
    return _session_of(pid) == str(os.getpid()).encode()


def _namespaces() -> set[str]:
    return {ns for ns in geotrain_namespaces() if _ours_or_orphan(ns[len(NS_PREFIX) :].split("-")[0])}


def _geotrain_links() -> set[str]:
    """Bridges and veths of emulated clusters in the root namespace (gtb-, gts, gtu, gtw, gtv)."""
    if netem_unavailable_reason():
        return set()
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}
    # gtb-RUNID, gtsRUNID-SITE, ...: the run id is 6 hex digits
    return {
        n
        for n in names
        if n[:3] in ("gtb", "gts", "gtu", "gtw", "gtv") and _ours_or_orphan(n[3:].lstrip("-")[:6])
    }


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves geotrain namespaces, links, trainers or coordinators behind."""
    before = _namespaces()
    links = _geotrain_links()
    procs = _geotrain_processes()
    yield
    # Another run's cluster that is being taken down lists its last links and namespaces a
    # moment after its state file is gone, as an orphan would: what is still there a second
    # later is left behind.
    for wait in (1.0, 0.0):
        left, left_links = _namespaces() - before, _geotrain_links() - links
        if not (left or left_links):
            break
        time.sleep(wait)
    assert not left, f"namespaces left behind: {left}"
    assert not left_links, f"links left behind: {left_links}"
    stray = _geotrain_processes() - procs
    assert not stray, f"processes left behind: {stray}"


@pytest.fixture
def cleanup_keepers():
    """Run directories (and their host counts) whose lingering keepers the test stops at the end."""
    from geotrain.launch.local import stop_keepers

    run_dirs: list[tuple[Path, int]] = []
    yield run_dirs
    for run_dir, n in run_dirs:
        stop_keepers(run_dir, n)
