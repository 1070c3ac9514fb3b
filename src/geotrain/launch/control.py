"""The launcher's side of the coordinator (``launch/coordinator.py``): starting its process, in a
namespace of its own on the emulated cluster or on loopback, waiting for its store, and starting
it again when it dies; and the sites of a ``--topology`` run's machines, which it is told.

Separate from ``local.py``, which runs the hosts and reads what the coordinator writes to the
run's ``control/`` folder.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from geotrain.ft.atomic import write_atomic
from geotrain.launch.faults import RunFailed
from geotrain.launch.procs import die_with_parent, host_env, stop_processes
from geotrain.netem.cluster import EmulatedCluster

if TYPE_CHECKING:
    from geotrain.launch.local import LaunchConfig

COORDINATOR_PORT = 29400  # in the coordinator's own namespace (emulated cluster)


def machine_sites(launch: LaunchConfig) -> list[int]:
    """The site of each machine of a ``--topology`` run: its hosts' (numbered site by site), then
    its ``--spares`` dealt over the sites in turn (spare k in site k mod S)."""
    hosts = launch.sites.host_sites()
    return hosts + [k % len(launch.sites.sites) for k in range(launch.spares)]


def start_coordinator(
    launch: LaunchConfig, cluster: EmulatedCluster | None, port: int = 0, wait: bool = True
) -> subprocess.Popen:
    """The coordinator (``launch/coordinator.py``): in its own namespace on the emulated cluster,
    on loopback otherwise. Returns its process, with the store's port as ``.port``. A restarted
    one (``port`` given) keeps the verdicts and the attempt of the one before. Without ``wait``
    it returns before the store is up (``coordinator_up`` waits): the hosts start meanwhile, as
    its port is chosen here and the trainers' store clients wait for it."""
    control = launch.run_dir / "control"
    restart, listener = bool(port), None
    if not port:
        # A fresh coordinator's control folder, but a resume keeps the sites --hierarchy auto
        # measured (train.py's _measured_sites): the sums' order, and so the bits, go with them.
        sites = control / "sites.json"
        kept = sites.read_bytes() if sites.exists() else None
        shutil.rmtree(control, ignore_errors=True)
        if kept is not None:
            control.mkdir(parents=True, exist_ok=True)
            write_atomic(sites, kept)
        if cluster is not None:
            port = COORDINATOR_PORT  # in a namespace of its own, fresh: nothing else listens there
        else:  # bound here and handed over: its port is known now, and no one else can take it
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = listener.getsockname()[1]
    control.mkdir(parents=True, exist_ok=True)
    (control / "port").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "geotrain.launch.coordinator", "--control-dir", str(control)]
    cmd += ["--hosts", str(launch.workers), "--fault-timeout", str(launch.fault_timeout_s)]
    cmd += ["--port", str(port)]
    cmd += ["--restart"] if restart else []
    cmd += ["--listen-fd", str(listener.fileno())] if listener is not None else []
    if launch.on_failure == "continue" and launch.workers > 1:
        cmd += ["--elastic"]
    if launch.sites is not None and launch.spares:
        cmd += ["--machine-sites", ",".join(map(str, machine_sites(launch)))]
    if cluster is not None:
        cmd = cluster.control_prefix() + cmd
    else:
        cmd += ["--bind", "127.0.0.1"]
    log = (launch.run_dir / "logs" / "coordinator.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=host_env(cluster, 1, launch.token), preexec_fn=die_with_parent,
                            pass_fds=(listener.fileno(),) if listener is not None else ())  # fmt: skip
    log.close()
    if listener is not None:
        listener.close()  # the coordinator holds its own copy
    proc.port = port  # type: ignore[attr-defined]
    if wait:
        coordinator_up(launch, proc)
    return proc


def coordinator_up(launch: LaunchConfig, proc: subprocess.Popen) -> None:
    """Wait for the coordinator's store to listen (it writes its port when it does)."""
    control = launch.run_dir / "control"
    deadline = time.monotonic() + 60
    while not (control / "port").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_processes([proc])
            raise RunFailed(f"the coordinator did not start; see {launch.run_dir}/logs/coordinator.log")
        time.sleep(0.05)


def restart_coordinator(
    launch: LaunchConfig, cluster: EmulatedCluster | None, dead: subprocess.Popen
) -> subprocess.Popen | None:
    """Training does not depend on the coordinator: a failed restart only stops the watch."""
    print("geotrain: the coordinator died; restarting it", file=sys.stderr, flush=True)
    try:
        return start_coordinator(launch, cluster, dead.port)  # type: ignore[attr-defined]
    except RunFailed as e:
        print(f"geotrain: {e}; silent hosts go unnoticed until --timeout-s", file=sys.stderr, flush=True)
        return None
