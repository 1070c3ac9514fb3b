import subprocess

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


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves geotrain namespaces behind."""
    before = set(geotrain_namespaces())
    yield
    left = set(geotrain_namespaces()) - before
    assert not left, f"namespaces left behind: {left}"
