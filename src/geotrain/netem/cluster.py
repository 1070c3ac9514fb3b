"""An emulated wide-area cluster on one machine: one network namespace per host.

Each host is a namespace with one interface, ``geo0``, whose veth peer sits on a bridge private
to the run. Each host's link is shaped with ``tc tbf`` in both directions: on ``geo0`` (what the
host sends) and on the bridge-side peer (what it receives). Hosts are 10.213.0.1, .2, ...

With sites (``netem/topology.py``), each site's hosts sit on a bridge of their own, and each site
bridge reaches the run's core bridge (where the coordinator is) through one veth pair shaped to the
site's WAN rate in both directions: a site's concurrent cross-site transfers share that uplink,
while its hosts talk to each other at their own (LAN) rate. Everything stays one layer-2 subnet,
so no host needs a route. The uplinks' byte counters say what crossed the WAN (``traffic``).

Every name carries a per-run id, so two runs never collide, and a state file under
``STATE_DIR`` names the launcher's pid and what it made. ``sweep_stale()`` removes what a dead
launcher left (SIGKILL, a crash) and touches nothing that is not geotrain's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from geotrain.ft.atomic import write_atomic

STATE_DIR = Path(os.environ.get("GEOTRAIN_NETEM_STATE", "/run/geotrain-netem"))
NS_PREFIX = "geotrain-"
SUBNET = "10.213.0"
BURST_FLOOR_BYTES = 3000  # two 1,500-byte packets: the least a token bucket can shape with
IFNAME = "geo0"
# One /24 on one bridge; the Linux bridge itself takes up to 1024 ports.
MAX_HOSTS = 250
CONTROL_HOST = 254  # the coordinator's address in the subnet


class NetemUnavailable(RuntimeError):
    """Namespaces or shaping cannot be made here (no root, no ip/tc)."""


def netem_unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command is not installed"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetemUnavailable(f"'{' '.join(args)}' failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _tbf(dev: str, bps: int, netns: str | None = None) -> None:
    # The bucket is what a link passes at the veth's own speed after an idle spell, so it is kept
    # to 1 ms of the rate (at least two full packets): with 10 ms (and 32 KB at least), a
    # 100 Mbit/s link passed 70 KB after a pause in 0.24 ms, not 5.7, so every step's first
    # 125 KB went free and small messages (a codec's, a tiny model's) looked 5-20x cheaper than
    # on a real link. 1 ms holds the sustained rate as well (94.7 Mbit/s of 100, 0.33 of 0.35,
    # 840 of 1,000 with one Python sender either way). The 200 ms queue keeps TCP from losing
    # packets at the shaper.
    burst = max(BURST_FLOOR_BYTES, bps // 8 // 1000)
    cmd = [
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{bps}bit",
        "burst",
        str(burst),
        "latency",
        "200ms",
    ]
    _sh(*(["ip", "netns", "exec", netns] if netns else []), *cmd)


@dataclass
class EmulatedCluster:
    """Namespaces, bridge and shaping for ``len(rates_bps)`` hosts; a context manager."""

    rates_bps: list[int]
    # With sites: the site of each host, and each site's uplink rate (bit/s).
    sites: list[int] | None = None
    wan_bps: list[int] | None = None
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    bridge: str = ""
    # Bridges and uplink veths made in the root namespace (the hosts' veths go with their namespace).
    links: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= len(self.rates_bps) <= MAX_HOSTS:
            raise ValueError(f"an emulated cluster has 1 to {MAX_HOSTS} hosts, got {len(self.rates_bps)}")
        if (self.sites is None) != (self.wan_bps is None):
            raise ValueError("sites and their WAN rates come together")
        if self.sites is not None and (
            len(self.sites) != len(self.rates_bps)
            or sorted(set(self.sites)) != list(range(len(self.wan_bps)))
        ):
            raise ValueError("every host needs a site, and every site a WAN rate")
        self.bridge = f"gtb-{self.run_id}"
        self._state = STATE_DIR / f"{self.run_id}.json"

    def site_bridge(self, site: int) -> str:
        return f"gts{self.run_id}-{site}"

    def uplink(self, site: int) -> str:
        """The site's end of its uplink: what it sends to other sites leaves through it."""
        return f"gtu{self.run_id}-{site}"

    def downlink(self, site: int) -> str:
        """The core's end of a site's uplink: what other sites send it leaves through it."""
        return f"gtw{self.run_id}-{site}"

    def traffic(self) -> dict[str, list[int]]:
        """Bytes on the wire so far (headers included): what each host sent, and what each site
        sent across its uplink (with sites). Read from the kernel's counters of the veths in the
        root namespace, so a host's own count cannot be skewed by what runs inside it."""

        def tx(dev: str) -> int:
            return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())

        def rx(dev: str) -> int:
            return int(Path(f"/sys/class/net/{dev}/statistics/rx_bytes").read_text())

        out = {"host_sent": [rx(f"gtv{self.run_id}-{i}") for i in range(len(self.rates_bps))]}
        if self.wan_bps is not None:
            out["wan_sent"] = [tx(self.uplink(s)) for s in range(len(self.wan_bps))]
        return out

    def host_ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def control_ip(self) -> str:
        """The coordinator's address: a namespace of its own on the bridge, its link unshaped."""
        return f"{SUBNET}.{CONTROL_HOST}"

    @property
    def control_netns(self) -> str:
        return f"{NS_PREFIX}{self.run_id}-ctl"

    def control_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.control_netns]

    def set_link(self, i: int, up: bool) -> None:
        """Cut host ``i`` off the network (its link down: peers get no reset) or bring it back."""
        _sh("ip", "netns", "exec", self.netns(i), "ip", "link", "set", IFNAME, "up" if up else "down")

    def netns(self, i: int) -> str:
        return f"{NS_PREFIX}{self.run_id}-h{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.netns(i)]

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"pid": os.getpid(), "namespaces": self.namespaces, "bridge": self.bridge}
        state["links"] = self.links
        # Atomic: a launcher killed mid-write must not leave a state the sweep cannot read.
        write_atomic(self._state, json.dumps(state).encode())

    def up(self) -> EmulatedCluster:
        reason = netem_unavailable_reason()
        if reason:
            raise NetemUnavailable(reason)
        self._write_state()  # first, so that a crash during set-up is swept too
        try:
            self._add_bridge(self.bridge)
            for site, bps in enumerate(self.wan_bps or []):
                self._add_bridge(self.site_bridge(site))
                up, down = self.uplink(site), self.downlink(site)
                self.links.append(up)  # recorded first, so a kill right after its creation is swept
                self._write_state()
                _sh("ip", "link", "add", up, "type", "veth", "peer", "name", down)  # one end takes both
                for dev, bridge in ((up, self.site_bridge(site)), (down, self.bridge)):
                    _sh("ip", "link", "set", dev, "master", bridge)
                    _sh("ip", "link", "set", dev, "up")
                    _tbf(dev, bps)  # up: the site's upload; down: its download
            for i, bps in enumerate(self.rates_bps):
                ns, outer = self.netns(i), f"gtv{self.run_id}-{i}"
                bridge = self.site_bridge(self.sites[i]) if self.sites is not None else self.bridge
                self._add_netns(ns, outer, f"gtp{self.run_id}-{i}", self.host_ip(i), bridge)
                _tbf(IFNAME, bps, netns=ns)  # upload
                _tbf(outer, bps)  # download
            control = (f"gtv{self.run_id}-c", f"gtp{self.run_id}-c")
            self._add_netns(self.control_netns, *control, self.control_ip, self.bridge)
        except BaseException:
            self.down()
            raise
        return self

    def _add_bridge(self, name: str) -> None:
        if name != self.bridge:
            self.links.append(name)
            self._write_state()
        _sh("ip", "link", "add", name, "type", "bridge")
        _sh("ip", "link", "set", name, "up")

    def _add_netns(self, ns: str, outer: str, inner: str, ip: str, bridge: str) -> None:
        _sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        # Its root end too: a namespace whose last process is still dying outlives its name, and
        # its veth pair with it, so the pair is deleted by name as well.
        self.links.append(outer)
        self._write_state()
        _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _sh("ip", "link", "set", inner, "netns", ns)
        _sh("ip", "link", "set", outer, "master", bridge)
        _sh("ip", "link", "set", outer, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "name", IFNAME)
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", IFNAME)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", IFNAME, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def down(self) -> None:
        _teardown(self.namespaces, self.bridge, self.links)
        self.namespaces, self.links = [], []
        self._state.unlink(missing_ok=True)

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def _kill_namespace_processes(ns: str) -> None:
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(int(pid), sig)
                alive.append(pid)
            except (ProcessLookupError, ValueError):
                pass
        if not alive:
            return
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and _sh("ip", "netns", "pids", ns, check=False).stdout.split():
            time.sleep(0.05)
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()


def _teardown(namespaces: list[str], bridge: str, links: list[str] = ()) -> None:
    for ns in namespaces:
        _kill_namespace_processes(ns)
        _sh("ip", "netns", "del", ns, check=False)  # takes the veth pair with it
    for link in [*links, bridge]:
        if link:
            _sh("ip", "link", "del", link, check=False)


def _links_of(run_id: str) -> list[str]:
    """Root-namespace links a run made (bridges, uplinks), by the run id in their names."""
    out = _sh("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith("gt") and n[3:].startswith(run_id)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def geotrain_namespaces() -> list[str]:
    if shutil.which("ip") is None:
        return []
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NS_PREFIX)]


def sweep_stale() -> list[str]:
    """Remove namespaces and bridges of geotrain runs whose launcher is dead. Returns what it removed."""
    if netem_unavailable_reason():
        return []
    removed: list[str] = []
    live_ids = set()
    if STATE_DIR.exists():
        for state_file in STATE_DIR.glob("*.json"):
            try:
                state = json.loads(state_file.read_text())
            except (OSError, json.JSONDecodeError):  # unreadable: whatever carries its run id
                run_id = state_file.stem
                named = [ns for ns in geotrain_namespaces() if ns[len(NS_PREFIX) :].startswith(f"{run_id}-")]
                state = {"pid": -1, "namespaces": named, "bridge": f"gtb-{run_id}"}
                state["links"] = _links_of(run_id)
            if state["pid"] > 0 and _pid_alive(state["pid"]):
                live_ids.add(state_file.stem)
                continue
            links = state.get("links", [])
            _teardown(state["namespaces"], state["bridge"], links)
            removed += state["namespaces"] + links + ([state["bridge"]] if state["bridge"] else [])
            state_file.unlink(missing_ok=True)
    # Namespaces named like ours with no live owner (a state directory lost with a reboot of /run).
    # A run that started since the state directory was read wrote its state before it made its
    # first namespace: the file is looked for again, so that run (another launcher on this
    # machine) keeps what it is building.
    for ns in geotrain_namespaces():
        run_id = ns[len(NS_PREFIX) :].split("-")[0]
        if run_id not in live_ids and not (STATE_DIR / f"{run_id}.json").exists():
            _teardown([ns], f"gtb-{run_id}", _links_of(run_id))
            removed.append(ns)
    return removed
