"""``geotrain run``: N emulated hosts on this machine, each running torchrun, as real machines would.

Every host runs the same command a user runs on a real machine::

    torchrun --nnodes N --nproc-per-node 1 --node-rank I --master-addr HOST0 --master-port 29500 \\
        -m geotrain.train ...

The static rendezvous (``--node-rank``) makes host I rank I on every launch: a host's keeper holds
that rank's snapshots, so a restarted host must get its rank back (the c10d rendezvous orders
hosts by address string, so ``10.213.0.10`` would come before ``10.213.0.2``).

Each host runs inside its own network namespace (``netns`` mode) or, where namespaces cannot be made, on
loopback, unshaped (``loopback`` mode); the summary records which. Each host's output goes to
``logs/host{i}.log``, and rank 0's progress bar to the terminal. On exit, on Ctrl-C, on a
failed host and on a timeout, every host process is stopped and the namespaces are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from geotrain.ft.atomic import write_atomic
from geotrain.ft.chaos import fired_marker, join_chaos, parse_chaos
from geotrain.ft.keeper import KeeperError
from geotrain.ft.membership import EXIT_BELOW_MIN_WORKERS, EXIT_NO_STATE_HOLDER
from geotrain.launch.admission import read_token, write_token
from geotrain.launch.control import coordinator_up, machine_sites, restart_coordinator, start_coordinator
from geotrain.launch.coordinator import read_jsonl, read_verdicts
from geotrain.launch.dist import choose_backend
from geotrain.launch.faults import (
    FaultRecord,
    RunFailed,
    TimedChaos,
    credit_regroups,
    last_step,
    read_faults,
    regroup_events,
    roll_back,
    trainer_pid,
    write_faults,
)
from geotrain.launch.keepers import (
    KEEPER_LINGER_S,
    keeper_socket,
    persist_keepers,
    start_keepers,
    stop_keepers,
)
from geotrain.launch.procs import die_with_parent, host_env, pump, stop_processes, tail_of
from geotrain.metrics import metrics_up_to
from geotrain.netem.cluster import EmulatedCluster, NetemUnavailable, netem_unavailable_reason, sweep_stale
from geotrain.netem.links import describe_links, format_bandwidth
from geotrain.netem.topology import parse_topology
from geotrain.train_config import TrainConfig

RDZV_PORT = 29500
ON_FAILURE = ("continue", "rollback", "stop")
MIN_FAULT_TIMEOUT_S = 2.0  # four heartbeats: one late beat on a busy link is not a failure


@dataclass
class LaunchConfig:
    workers: int
    rates_bps: list[int] | None  # None: unshaped
    run_dir: Path
    netem: bool = True
    timeout_s: float = 3600.0  # the whole run's (0: none)
    echo: bool = True  # copy hosts' output to this terminal
    keepers: bool = True  # one keeper process per host, holding snapshots in memory
    # continue: the survivors regroup and go on | rollback: restore every worker from snapshots
    # and go on | stop
    on_failure: str = "continue"
    max_faults: int = 10  # the run fails at the fault after this many
    min_workers: int = 1  # with continue: fewer workers pause for joiners, then stop
    join_timeout_s: float = 120.0  # how long they wait for a joiner before they snapshot and stop
    fault_timeout_s: float = 10.0  # a host whose heartbeat stops this long has failed
    spares: int = 0  # with continue: hosts waiting in a backup pool to take a lost host's place
    topology: str = ""  # sites (netem/topology.py): hosts on LANs, each site behind one WAN uplink
    token: str = ""  # the run token (launch/admission.py); run_local_cluster makes one if empty
    gpus: tuple[str, ...] = ()  # CUDA devices of this machine, dealt to its hosts (run_local_cluster)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.rates_bps is not None and len(self.rates_bps) != self.workers:
            raise ValueError("one rate per worker")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"--on-failure {self.on_failure!r}: accepted: {', '.join(ON_FAILURE)}")
        if self.max_faults < 0:
            raise ValueError(f"--max-faults must be >= 0, got {self.max_faults}")
        if not 1 <= self.min_workers <= self.workers:
            raise ValueError(
                f"--min-workers must be in [1, --workers {self.workers}], got {self.min_workers}"
            )
        if self.spares < 0:
            raise ValueError(f"--spares must be >= 0, got {self.spares}")
        if self.spares and (self.on_failure != "continue" or self.workers < 2):
            raise ValueError(
                "--spares needs --on-failure continue and --workers >= 2 (spares replace lost members)"
            )
        # The sites, parsed once (netem/topology.py); None without --topology.
        self.sites = sites = parse_topology(self.topology) if self.topology else None
        if sites is not None:
            if sites.workers != self.workers:
                raise ValueError(f"--topology {self.topology} has {sites.workers} hosts, not {self.workers}")
            if self.rates_bps and self.rates_bps != sites.host_rates():
                raise ValueError(f"--topology {self.topology}: its hosts' links run at its lan= rate")
        if self.join_timeout_s < 0:
            raise ValueError(f"--join-timeout must be >= 0 seconds, got {self.join_timeout_s}")
        if self.timeout_s < 0:
            raise ValueError(f"--timeout must be >= 0 seconds (0: never), got {self.timeout_s}")
        if self.fault_timeout_s < MIN_FAULT_TIMEOUT_S:
            raise ValueError(
                f"--fault-timeout must be >= {MIN_FAULT_TIMEOUT_S:g} seconds (4 heartbeats), "
                f"got {self.fault_timeout_s}"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_command(n: int, host: int, master_addr: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "geotrain.launch.agent",  # torchrun, its failure report kept to the host's log
        "--nnodes",
        str(n),
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(host),
        "--master-addr",
        master_addr,
        "--master-port",
        str(port),
        "--max-restarts",
        "0",
        "-m",
        "geotrain.train",
    ]


@dataclass
class _Hosts:
    procs: list[subprocess.Popen]
    pumps: list[threading.Thread]
    logs: list[IO[bytes]]

    def close(self) -> None:
        for t in self.pumps:
            t.join(timeout=2)
        for log in self.logs:
            with contextlib.suppress(OSError):  # a full disk: what the log still buffers is lost
                log.close()
        self.logs = []


def _gpu_of(launch: LaunchConfig, machine: int) -> str:
    return launch.gpus[machine % len(launch.gpus)] if launch.gpus else ""


def _spawn(hosts: _Hosts, launch: LaunchConfig, cluster, i: int, cmd: list[str], threads: int, mode: str):
    """Start host ``i``'s command (in its namespace), its output pumped to its log."""
    if cluster:
        cmd = cluster.exec_prefix(i) + cmd
    log = (launch.run_dir / "logs" / f"host{i}.log").open(mode)
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=host_env(cluster, threads, launch.token, _gpu_of(launch, i)),
        preexec_fn=die_with_parent,
    )
    t = threading.Thread(target=pump, args=(p.stdout, log, launch.echo), daemon=True)
    t.start()
    hosts.logs.append(log)
    hosts.pumps.append(t)
    return p


def _heartbeat_spec(cluster, coordinator: subprocess.Popen, attempt: int, host: int) -> str:
    addr = cluster.control_ip if cluster else "127.0.0.1"
    return f"{addr}:{coordinator.port}:{attempt}:{host}"  # type: ignore[attr-defined]


def _start_hosts(
    launch: LaunchConfig,
    cluster: EmulatedCluster | None,
    cfg: TrainConfig,
    sockets: list[Path],
    threads: int,
    attempt: int,
    coordinator: subprocess.Popen | None = None,
) -> _Hosts:
    """Start one torchrun per host; each attempt after a fault gets a rendezvous of its own."""
    port = RDZV_PORT + attempt if cluster else _free_port()
    master = cluster.host_ip(0) if cluster else "127.0.0.1"
    hosts = _Hosts([], [], [])
    for i in range(launch.workers):
        cmd = _torchrun_command(launch.workers, i, master, port)
        host_cfg = replace(cfg, keeper=str(sockets[i])) if sockets else cfg
        if coordinator is not None:
            host_cfg = replace(host_cfg, heartbeat=_heartbeat_spec(cluster, coordinator, attempt, i))
        cmd += host_cfg.to_argv()
        cmd += ["--threads", str(threads), "--progress" if i == 0 and cfg.progress else "--no-progress"]
        mode = "ab" if cfg.resume or attempt else "wb"
        hosts.procs.append(_spawn(hosts, launch, cluster, i, cmd, threads, mode))
    return hosts


def _start_joiner(
    hosts: _Hosts, launch: LaunchConfig, cluster, cfg: TrainConfig, host: int, threads: int, attempt: int,
    coordinator: subprocess.Popen, faults: list, keeper: str = "", machine: int | None = None,
    spare: bool = False,
) -> subprocess.Popen:  # fmt: skip
    """A replacement for ``host`` under continue, on ``machine`` (its namespace and log; the
    host's own by default): a plain trainer process (no torchrun: the first rendezvous may be
    gone with its host) that asks the coordinator to be admitted. Its snapshots go to the host's
    keeper (``keeper``), as its predecessor's did. ``spare``: it waits in the backup pool
    instead, until the coordinator gives it a lost host's place (``host`` is then its machine's
    label, and ``keeper`` names any host's keeper with ``{host}``)."""
    machine = host if machine is None else machine
    if not spare:
        (launch.run_dir / "control" / f"exit-{host}").unlink(missing_ok=True)
    if cluster is not None:
        cluster.set_link(machine, up=True)
    joiner = replace(
        cfg, join=not spare, spare=spare, keeper=keeper, chaos=join_chaos(faults),
        resume=False, resume_step=0, heartbeat=_heartbeat_spec(cluster, coordinator, attempt, host),
    )  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "geotrain.train",
        *joiner.to_argv(),
        "--threads",
        str(threads),
        "--no-progress",
    ]
    return _spawn(hosts, launch, cluster, machine, cmd, threads, "ab")


def _host_code(proc: subprocess.Popen, control: Path, host: int, elastic: bool) -> int | None:
    """A host's exit code, or None while it runs. With continue, a trainer that said it finished
    counts as finished: its torchrun agent waits up to 300 s for the agents of lost hosts; one
    that stopped below --min-workers says so (torchrun reports any error as 1)."""
    code = proc.poll()
    if elastic:
        with contextlib.suppress(OSError):
            said = (control / f"exit-{host}").read_text().strip()
            if said == "0" and code is None:
                return 0
            if said in (str(EXIT_BELOW_MIN_WORKERS), str(EXIT_NO_STATE_HOLDER)):
                return int(said)
    return code


def _take_fired(faults: list, control: Path, failed: int | None = None) -> list:
    """The step faults that have fired (their trainer left a marker just before), by step,
    taken out of ``faults``: all of them, or (``failed``) the one aimed at that host (else the
    earliest), the others left for their own hosts' failures: two hosts killed at the same step
    are two faults, each with its replacement (the second was recorded as an exit, and its
    replacement never came)."""
    fired = [f for f in faults if not f.timed and fired_marker(control, f).exists()]
    fired.sort(key=lambda f: f.step)
    if failed is not None and fired:
        fired = [next((f for f in fired if f.rank == failed), fired[0])]
    for f in fired:
        faults.remove(f)
    return fired


def wire_bytes(traffic: dict[str, list[int]], steps: int) -> dict:
    """Bytes per step on the sites' LANs and across their WAN uplinks, as the kernel counted them
    on the wire (headers, rendezvous and heartbeats included), over the ``steps`` this launch
    trained (redone ones included). A byte between sites leaves its site once (``wan``); the rest
    of what hosts sent stayed inside."""
    steps = max(1, steps)
    wan = sum(traffic["wan_sent"])
    return {
        "wan_bytes_per_step": wan / steps,
        "lan_bytes_per_step": max(0, sum(traffic["host_sent"]) - wan) / steps,
        "wan_bytes_per_step_by_site": [b / steps for b in traffic["wan_sent"]],
    }


def visible_gpus() -> tuple[str, ...]:
    """The CUDA devices this machine shows its processes, as ``CUDA_VISIBLE_DEVICES`` names them."""
    import torch

    if not torch.cuda.is_available():
        return ()
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return tuple(named or map(str, range(torch.cuda.device_count())))[: torch.cuda.device_count()]


def backend_for_hosts(cfg: TrainConfig, machines: int, gpus: int) -> TrainConfig:
    """``cfg`` with the backend for ``machines`` emulated hosts (spares included) on ``gpus`` GPUs
    (``choose_backend``'s rule, for the hosts of this machine): auto is left to each trainer where
    every host has a GPU of its own or there is none, and made gloo where hosts must share."""
    try:
        chosen = choose_backend(cfg.backend, gpus, machines, who="hosts")
    except ValueError as e:
        raise RunFailed(f"--{e}") from None
    return replace(cfg, backend="gloo") if gpus and chosen == "gloo" and cfg.backend != "gloo" else cfg


def run_local_cluster(launch: LaunchConfig, train_cfg: TrainConfig) -> dict:
    """Start the hosts, wait for them, clean up. Returns the summary rank 0 wrote."""
    run_dir = launch.run_dir
    launch = replace(launch, gpus=visible_gpus())
    train_cfg = backend_for_hosts(train_cfg, launch.workers + launch.spares, len(launch.gpus))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not launch.token:  # the user's $GEOTRAIN_TOKEN, else one of this run's own (kept for a resume)
        launch = replace(launch, token=read_token(train_cfg.token_file) or write_token(run_dir / "token"))
    mode, cluster, reason = "loopback", None, None
    if launch.netem and launch.rates_bps is not None:
        reason = netem_unavailable_reason()
        if reason is None:
            sweep_stale()
            try:
                # Spares are machines of their own, on the slowest of the hosts' links; on sites,
                # dealt over the sites in turn, behind their uplinks.
                spare_links = [min(launch.rates_bps)] * launch.spares
                sites = launch.sites
                cluster = EmulatedCluster(
                    launch.rates_bps + spare_links,
                    sites=machine_sites(launch) if sites else None,
                    wan_bps=list(sites.wan_bps) if sites else None,
                ).up()
                mode = "netns"
            except NetemUnavailable as e:
                reason = str(e)
        if reason:
            print(
                f"geotrain: cannot emulate links ({reason}); running on loopback, UNSHAPED", file=sys.stderr
            )
    elif launch.rates_bps is None:
        reason = "no --bandwidth given"
    link = (
        describe_links(launch.rates_bps) if (mode == "netns" and launch.rates_bps) else "loopback (unshaped)"
    )
    slowest = min(launch.rates_bps) if launch.rates_bps else 0
    if mode == "netns" and launch.sites is not None:
        link, slowest = launch.sites.describe(), launch.sites.slowest_share_bps()
    if train_cfg.latency_ms:
        link += f" +{train_cfg.latency_ms:g}ms emulated latency"
    elastic = launch.on_failure == "continue" and launch.workers > 1 and not train_cfg.profile_out
    cfg = replace(
        train_cfg,
        run_dir=str(run_dir),
        link=link,
        # The collective timeout is sized for the slowest link (unless --timeout-s is given).
        link_rate=format_bandwidth(slowest) if mode == "netns" and slowest else train_cfg.link_rate,
        network_mode=mode,
        elastic=elastic,
        fault_timeout_s=launch.fault_timeout_s,
        min_workers=launch.min_workers,
        join_timeout=launch.join_timeout_s,
    )
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                "train": cfg.__dict__,
                "workers": launch.workers,
                "network_mode": mode,
                "fallback_reason": reason,
                "rates_bps": launch.rates_bps,
                "topology": launch.topology,
                "spares": launch.spares,
            },
            indent=2,
        )
        + "\n"
    )

    threads = max(1, (os.cpu_count() or 1) // launch.workers)
    keepers = launch.keepers and not cfg.profile_out
    rollback = launch.on_failure == "rollback" and not cfg.profile_out
    faults = parse_chaos(cfg.chaos, launch.workers)
    timed = TimedChaos(faults, seed=cfg.seed)
    records: list[FaultRecord] = read_faults(run_dir) if cfg.resume else []
    sockets: list[Path] = []
    coordinator: subprocess.Popen | None = None
    control = run_dir / "control"
    succeeded = False
    hosts: _Hosts | None = None
    pool: dict[int, subprocess.Popen] = {}  # spare machines waiting for a lost host's place
    interrupted = False
    previous_handlers = {}
    traffic: dict[str, list[int]] | None = None  # bytes on the wire, read before the links go

    def _on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a process started in the background inherits it ignored, and Ctrl-C must still
    # stop the hosts and remove the namespaces.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous_handlers[sig] = signal.signal(sig, _on_signal)
    t_launch = time.monotonic()
    deadline = t_launch + launch.timeout_s if launch.timeout_s > 0 else float("inf")
    try:
        if any(f.kind == "cut" for f in faults) and mode != "netns":
            raise RunFailed("--chaos cut needs emulated links, and this run fell back to loopback")
        sockets = start_keepers(run_dir, launch.workers, cfg.resume) if keepers else []
        coordinator = start_coordinator(launch, cluster, wait=False) if not cfg.profile_out else None
        coordinator_waited = False
        attempt, stuck, start_step = 0, 0, cfg.resume_step if cfg.resume else 0
        prior = len(records)  # faults of earlier launches: reported, not counted again
        for rank in range(launch.workers):  # what an earlier launch wrote past this start is void
            metrics_up_to(run_dir, rank, start_step)
        dead: set[int] = set()  # with continue: hosts the survivors went on without
        # With continue: machines coming back, by machine: (when, its fault, the host it served).
        rejoin: dict[int, tuple[float, FaultRecord, int]] = {}
        handled: set[tuple[int, float]] = set()  # silent verdicts acted on (host, when)
        joiners: set[int] = set()
        machine_of = list(range(launch.workers))  # the machine (namespace, log) serving each host
        placed = 0  # hand-outs of control/spares.jsonl acted on
        earlier_regroups: list[dict] = []  # of the epochs before every host was restored
        keeper_any = str(keeper_socket(run_dir, 0)).replace("host0.sock", "host{host}.sock")

        def start_spare(machine: int) -> None:
            pool[machine] = _start_joiner(
                hosts, launch, cluster, cfg, machine, threads, attempt, coordinator, faults,  # type: ignore[arg-type]
                keeper_any if sockets else "", spare=True,
            )  # fmt: skip

        while True:
            if hosts is None:
                if coordinator is not None:
                    write_atomic(control / "attempt", str(attempt).encode())
                for old in control.glob("fatal-*"):
                    old.unlink()
                if cluster is not None:  # links cut by chaos come back for the next attempt
                    for i in range(launch.workers):
                        cluster.set_link(i, up=True)
                hosts = _start_hosts(launch, cluster, cfg, sockets, threads, attempt, coordinator)
                if coordinator is not None and not coordinator_waited:  # it started beside them
                    coordinator_up(launch, coordinator)
                    coordinator_waited = True
                if elastic and coordinator is not None:
                    for m in range(launch.workers, launch.workers + launch.spares):
                        start_spare(m)
                started_wall = time.time()
                armed = False  # timed faults count from the first step: not during start-up
            recovering = records[-1] if len(records) > prior and records[-1].recover_s is None else None
            failed, silent_s, seen_bad, no_holder_at = None, 0.0, [], 0.0
            while True:
                codes = [_host_code(p, control, i, elastic) for i, p in enumerate(hosts.procs)]
                live = [i for i in range(launch.workers) if i not in dead]
                if live and all(codes[i] == 0 for i in live):  # (none live: replacements are due)
                    break
                if any(codes[i] == EXIT_BELOW_MIN_WORKERS for i in live):
                    at = max(last_step(run_dir, i)[0] for i in live)
                    raise RunFailed(
                        f"{len(live)} worker(s) left, fewer than --min-workers {launch.min_workers}, and no "
                        f"replacement came within --join-timeout {launch.join_timeout_s:g} s: stopped after "
                        f"step {at} with their snapshots. geotrain run --resume {run_dir} goes on from "
                        "there (hosts lost before it come back from a member's state)"
                    )
                # The first to fail, in the order noticed; in one poll, one that did not exit in
                # order (no "bye") before its peers, which exit on the broken collective.
                new_bad = [i for i in live if codes[i] not in (None, 0) and i not in seen_bad]
                # A joiner that found no member to admit it (5) comes after the members' own
                # failures, which its peers' coordinator may have seen first: the restore is
                # recorded against the last of them (a frozen one, against its silence).
                if any(codes[i] == EXIT_NO_STATE_HOLDER for i in new_bad):
                    no_holder_at = no_holder_at or time.monotonic()
                    if time.monotonic() - no_holder_at < launch.fault_timeout_s + 30 and any(
                        codes[i] is None and i not in joiners for i in live
                    ):
                        new_bad = [i for i in new_bad if codes[i] != EXIT_NO_STATE_HOLDER]
                said_bye = {i: (control / f"bye-{attempt}-{i}").exists() for i in new_bad}
                seen_bad += sorted(new_bad, key=lambda i: (codes[i] == EXIT_NO_STATE_HOLDER, said_bye[i]))
                if seen_bad:
                    failed = seen_bad[0]
                    break
                silent = [
                    v for v in (read_verdicts(control, attempt) if coordinator is not None else [])
                    if codes[v["host"]] is None and v["host"] not in dead
                    and (v["host"], v["at"]) not in handled
                ]  # fmt: skip
                if silent:
                    failed, silent_s = silent[0]["host"], silent[0]["silent_s"]
                    handled.add((failed, silent[0]["at"]))
                    break
                now = time.monotonic()
                hand_outs = read_jsonl(control / "spares.jsonl") if pool else []
                for given in hand_outs[placed:]:  # the coordinator gave a spare a lost host's place
                    h, m = int(given["host"]), int(given["label"])
                    if given.get("revoked"):  # silent before it was admitted: it is stopped
                        placed += 1
                        if machine_of[h] == m and h not in dead and h in joiners:
                            stop_processes([hosts.procs[h]], grace_s=0.5)
                            dead.add(h)
                            why = f"spare host {m} went silent before it was admitted"
                            print(f"geotrain: {why}; host {h}'s place goes to the next spare",
                                  file=sys.stderr, flush=True)  # fmt: skip
                        continue
                    fresh = time.time() - given["at"] < launch.fault_timeout_s + 10
                    if m in pool and h not in dead and fresh:
                        break  # its failure is not noticed here yet (a deathrattle is faster)
                    placed += 1
                    if m not in pool or h not in dead:
                        continue
                    hosts.procs[h], machine_of[h] = pool.pop(m), m
                    (control / f"exit-{h}").unlink(missing_ok=True)
                    dead.discard(h)
                    joiners.add(h)
                    fault = next((r for r in reversed(records) if r.rank == h), None)
                    if fault is not None and not fault.rejoin_started_at:
                        fault.rejoin_started_at = given["at"]
                    print(f"geotrain: spare host {m} takes host {h}'s place", file=sys.stderr, flush=True)
                for m, (due, fault, h) in list(rejoin.items()):
                    if now >= due and coordinator is not None:
                        del rejoin[m]
                        if launch.spares:  # the pool fills vacancies: this machine joins it
                            start_spare(m)
                            print(f"geotrain: host {m} is back, as a spare", file=sys.stderr, flush=True)
                            continue
                        if sockets:  # a host lost whole gets an empty keeper for its snapshots
                            try:
                                start_keepers(run_dir, launch.workers, resume=True)
                            except KeeperError as e:
                                print(f"geotrain: {e}; host {h}'s replacement keeps no snapshots in memory",
                                      file=sys.stderr, flush=True)  # fmt: skip
                        hosts.procs[h] = _start_joiner(
                            hosts, launch, cluster, cfg, h, threads, attempt, coordinator, faults,
                            str(sockets[h]) if sockets else "", machine=m,
                        )  # fmt: skip
                        machine_of[h] = m
                        dead.discard(h)
                        joiners.add(h)  # its process is the trainer itself, not torchrun's agent
                        fault.rejoin_started_at = time.time()
                        print(
                            f"geotrain: a replacement for host {h} asks to join", file=sys.stderr, flush=True
                        )
                if now > deadline:
                    raise RunFailed(
                        f"the run exceeded its {launch.timeout_s:.0f} s timeout; logs in {run_dir}/logs"
                    )
                # The furthest live host: a replacement's file (its predecessor's steps) moves only
                # once it is admitted, so watching it made recoveries look as long as admissions.
                progress = max((last_step(run_dir, i)[0] for i in live), default=start_step)
                if recovering is not None and progress > recovering.rollback_to:
                    recovering.recover_s = round(time.time() - recovering.detected_at, 2)
                    write_faults(run_dir, records)
                    recovering = None
                if not armed and progress > start_step:
                    timed.arm(now)
                    armed = True
                if armed and progress < cfg.steps and not any(c == 0 for c in codes):  # not at the end
                    timed.poll(now, [
                        None if i in dead or p.poll() is not None
                        else p.pid if i in joiners else trainer_pid(p.pid)
                        for i, p in enumerate(hosts.procs)
                    ])  # fmt: skip
                if coordinator is not None and coordinator.poll() is not None:
                    coordinator = restart_coordinator(launch, cluster, coordinator)
                time.sleep(0.1)
            if failed is None:
                stop_processes(
                    list(pool.values()), grace_s=2.0
                )  # spares not needed (they see the run finished)
                for p in hosts.procs:  # agents waiting at torchrun's exit barrier for lost ones
                    if elastic and p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGKILL)
                if recovering is not None:  # it finished before a new step was seen
                    recovering.recover_s = round(time.time() - recovering.detected_at, 2)
                succeeded = True
                break
            if elastic and codes[failed] == EXIT_NO_STATE_HOLDER and len(records) > prior:
                # Every member holding the state was lost before a joiner was admitted: nobody
                # is left to hand it over. Every host restarts from the newest snapshot that
                # all can restore, as under rollback (the joiners' hosts from a member's), on a
                # fresh coordinator (its epochs begin again with every host).
                record = records[-1]  # the fault that took the last holder
                stop_processes(hosts.procs + list(pool.values()), grace_s=1.0)
                hosts.close()
                hosts, coordinator_waited = None, False
                if coordinator is not None:
                    (control / "stop").touch()
                    stop_processes([coordinator], grace_s=2.0)
                _take_fired(faults, control)  # their markers go with control/: they must not fire again
                # A fresh coordinator empties control/: its records are kept beside it.
                earlier_regroups += regroup_events(control)
                kept = run_dir / f"control-before-restore-{attempt}"
                shutil.rmtree(kept, ignore_errors=True)
                shutil.copytree(control, kept)
                coordinator = start_coordinator(launch, cluster, wait=False)
                pool, dead, joiners, rejoin, handled, placed = {}, set(), set(), {}, set(), 0
                machine_of, timed.fired, stuck = list(range(launch.workers)), None, 0
                cfg = roll_back(run_dir, launch, cfg, sockets, faults, record)
                start_step = record.rollback_to
                write_faults(run_dir, records)
                print(
                    f"geotrain: no member holding the training state is left (host {record.rank} "
                    f"was the last; the joiners had not been admitted): all workers continue from "
                    f"step {start_step} of their snapshots ({record.steps_lost} steps redone)",
                    file=sys.stderr,
                    flush=True,
                )
                attempt += 1
                continue
            # A host failed: note it, stop the rest, and decide whether the run goes on.
            detected_wall = time.time()
            code = hosts.procs[failed].poll()
            reached = [last_step(run_dir, r) for r in range(launch.workers)]
            furthest = max(s for s, _ in reached)
            fatal = sorted(control.glob("fatal-*"))
            if timed.fired is not None and hosts.procs[timed.fired[1]].poll() not in (None, 0):
                failed = timed.fired[1]  # the one it killed, not a peer that fell with it
            if elastic:  # the failed host only: a frozen one must not come back into the new epoch
                stop_processes([hosts.procs[failed]], grace_s=0.5)
            else:  # no grace for survivors: their state is in the keepers, and one may be frozen
                stop_processes(hosts.procs, grace_s=1.0)
                hosts.close()
                hosts = None
            fired = _take_fired(faults, control, failed)
            kind, rank, restart_s = ("exit" if code is not None else "silent"), failed, 0.0
            if fired:
                kind, rank, restart_s = fired[0].kind, fired[0].rank, fired[0].restart_s
            elif timed.fired is not None and timed.fired[1] == failed:
                kind, restart_s = timed.fired[0].kind, timed.fired[0].restart_s
            if code is None:  # silent: its last beat
                last_alive = detected_wall - silent_s
            elif timed.fired is not None and timed.fired[1] == rank:
                last_alive = timed.fired[2]
            else:  # its last metrics line of this attempt
                last_alive = max(reached[rank][1], started_wall)
            timed.fired = None
            record = FaultRecord(
                kind=kind,
                rank=rank,
                at_s=round(time.monotonic() - t_launch, 2),
                at_step=furthest,
                detected_s=round(max(0.0, detected_wall - last_alive), 2),
                exit_code=code,
                detected_at=detected_wall,
            )
            records.append(record)
            write_faults(run_dir, records)
            what = f"exited with code {code}" if code is not None else f"went silent for {silent_s:.1f} s"
            log = run_dir / "logs" / f"host{machine_of[failed]}.log"
            log_tail = f"; its log ({log}) ends:\n" + tail_of(log)
            if fatal:  # bad input, or a collective timeout: the same on every attempt
                said = fatal[0].name.removeprefix("fatal-rank")
                who = "" if said == str(failed) else f"; host {said}"
                raise RunFailed(f"host {failed} {what}{who}: {fatal[0].read_text().strip()}")
            if (rollback or elastic) and len(records) - prior > launch.max_faults:
                raise RunFailed(
                    f"host {failed} {what}; {len(records) - prior} faults, more than --max-faults "
                    f"{launch.max_faults}{log_tail}"
                )
            if elastic:
                # The deathrattle: the coordinator publishes the next epoch at once (a silent host
                # it has found itself) and the survivors regroup without it.
                dead.add(failed)
                if sockets and launch.spares:  # a spare takes its place at once: its keeper must be there
                    with contextlib.suppress(KeeperError):
                        start_keepers(run_dir, launch.workers, resume=True)
                write_atomic(control / f"dead-{failed}", b"")
                record.rollback_to = furthest  # nobody goes back: the survivors keep their steps
                write_faults(run_dir, records)
                left = launch.workers - len(dead)
                if restart_s:
                    rejoin[machine_of[failed]] = (time.monotonic() + restart_s, record, failed)
                coming = rejoin or any(p.poll() is None for p in pool.values())  # (spares that live)
                if not left and not (coming and coordinator is not None):
                    raise RunFailed(
                        f"host {failed} {what}; no worker left. The keepers hold the last snapshots: "
                        f"geotrain run --resume {run_dir}{log_tail}"
                    )
                if not left:  # a replacement will find nobody to hand it the state (see above)
                    print(
                        f"geotrain: host {rank} failed after step {furthest} ({kind}); no worker is "
                        "left: once a replacement comes, every host restarts from the snapshots",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                then = f"; a replacement comes in {restart_s:g} s" if restart_s else ""
                if pool:
                    then = f"; one of {len(pool)} spare(s) takes its place"
                if left < launch.min_workers:
                    then += (
                        f"; fewer than --min-workers {launch.min_workers}: they pause after their next "
                        f"sync boundary and wait up to {launch.join_timeout_s:g} s for a replacement"
                    )
                    if restart_s > launch.join_timeout_s:
                        then += " (this one comes later than that: raise --join-timeout)"
                print(
                    f"geotrain: host {rank} failed after step {furthest} ({kind}); the {left} others "
                    f"go on without it{then}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            if not rollback:
                raise RunFailed(f"host {failed} {what}{log_tail}")
            # A failure of its own (no chaos) before any new step, twice running: it will fail the
            # same way after every rollback.
            stuck = stuck + 1 if kind in ("exit", "silent") and furthest <= start_step else 0
            if stuck >= 2:
                raise RunFailed(
                    f"host {failed} {what} before any new step, twice running; not retrying{log_tail}"
                )
            time.sleep(restart_s)  # the replacement's time to come up
            cfg = roll_back(run_dir, launch, cfg, sockets, faults, record)
            start_step = record.rollback_to
            write_faults(run_dir, records)
            print(
                f"geotrain: host {rank} failed after step {furthest} ({kind}); all workers continue "
                f"from step {record.rollback_to} ({record.steps_lost} steps redone)",
                file=sys.stderr,
                flush=True,
            )
            attempt += 1
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        try:
            if interrupted and cluster is not None:
                # Ctrl-C: remove the hosts first (this kills every process in them), then reap.
                cluster.down()
            if hosts is not None:
                stop_processes(hosts.procs + list(pool.values()), grace_s=2.0 if interrupted else 5.0)
                hosts.close()
            if coordinator is not None:
                (control / "stop").touch()
                stop_processes([coordinator], grace_s=2.0)
            if cluster is not None:
                with contextlib.suppress(OSError):  # a cluster already taken down has no counters
                    traffic = cluster.traffic()
                cluster.down()
            if sockets and succeeded:
                stop_keepers(run_dir, launch.workers)
            elif sockets:
                print("geotrain: writing the keepers' snapshots to disk...", file=sys.stderr, flush=True)
                step = persist_keepers(sockets, run_dir / "snapshots")
                if step is not None:
                    print(
                        f"geotrain: every worker's state at step {step} is on disk "
                        f"({run_dir}/snapshots): geotrain run --resume {run_dir}",
                        file=sys.stderr,
                    )
                else:
                    print(
                        f"geotrain: the keepers hold this run's last snapshots in memory for "
                        f"{KEEPER_LINGER_S / 60:.0f} min: geotrain run --resume {run_dir}",
                        file=sys.stderr,
                    )
        finally:  # a caller that goes on (geotrain bench, a test) gets its own handlers back
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
    if cfg.profile_out:
        if not Path(cfg.profile_out).exists():
            raise RunFailed(f"the hosts finished but wrote no profile; see {run_dir}/logs")
        return json.loads(Path(cfg.profile_out).read_text())
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RunFailed(f"the hosts finished but wrote no summary; see {run_dir}/logs")
    summary = json.loads(summary_path.read_text())
    if traffic is not None and "wan_sent" in traffic:
        start = train_cfg.resume_step if train_cfg.resume else 0  # the step this launch began at
        redone = sum(r.steps_lost for r in records[prior:])
        summary |= wire_bytes(traffic, int(summary["steps"]) - start + redone)
        write_atomic(summary_path, (json.dumps(summary, indent=2) + "\n").encode())
    if elastic:
        regroups = regroup_events(control) or summary.get("membership") or []
        summary["membership"] = earlier_regroups + regroups
        credit_regroups(records[prior:], summary["membership"])
        write_faults(run_dir, records)
    if records or launch.on_failure != "stop":
        summary["on_failure"] = launch.on_failure
        summary["faults"] = [r.as_dict() for r in records]
        write_atomic(summary_path, (json.dumps(summary, indent=2) + "\n").encode())
    return summary
