"""The trainer process's way into and out of a run, around the loop (``train.py``): proving the
run's token before anything else (admission), a spare's wait for a lost host's place, a broker's
address and the coordinator's first word on the run's hosts; at the end, the goodbye to the
coordinator and the launcher, and the mark of a fatal error that must not be retried.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch.distributed as dist

from geotrain.ft.atomic import write_atomic
from geotrain.ft.membership import (
    EXIT_BELOW_MIN_WORKERS,
    RETIRED,
    RunFinished,
    first_hosts,
    host_beating,
    spare_placed,
    wait_for_vacancy,
)
from geotrain.launch.admission import Pass, prove, read_token
from geotrain.launch.coordinator import Heartbeat
from geotrain.sync import ConfigError
from geotrain.train_config import TrainConfig


def _admit(cfg: TrainConfig) -> Pass | None:
    """Prove to the run's coordinator (or broker) that this worker holds the run token, before
    anything else; returns its pass (None: no coordinator to prove it to)."""
    if cfg.broker:
        where = broker_address(cfg.broker, 0 if cfg.spare else cfg.host)
    elif cfg.heartbeat:
        where = cfg.heartbeat.rsplit(":", 2)[0]
    else:
        return None
    addr, port = where.rsplit(":", 1)
    try:
        token = read_token(cfg.token_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        store = dist.TCPStore(
            addr, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
    except Exception as e:  # a broker that is gone (the run is over) or never was
        raise RunFinished(f"no coordinator answers at {where} ({type(e).__name__})") from None
    return prove(store, token, cfg.host if cfg.broker or cfg.spare else int(cfg.heartbeat.rsplit(":", 1)[1]))


def take_a_place(cfg: TrainConfig, admitted: Pass | None = None) -> TrainConfig:
    """A spare (``--spare``): wait in the backup pool of the coordinator (``--heartbeat``, set by
    the launcher) or broker (``--broker``) until it gives this process a lost host's place, and
    return the config of that host's replacement (``--join`` as that host, its keeper)."""
    if cfg.broker:
        addr, port = broker_address(cfg.broker, 0).rsplit(":", 1)
        attempt, label = "0", str(cfg.host)
    elif cfg.heartbeat and cfg.elastic:
        addr, port, attempt, label = cfg.heartbeat.rsplit(":", 3)
    else:
        raise ConfigError("--spare needs --broker ADDR:PORT (or the launcher's --heartbeat and --elastic)")
    name = f"spare {label}" if int(label) >= 0 else "spare"
    print(f"geotrain: {name} waits in the backup pool at {addr}:{port}", file=sys.stderr, flush=True)
    host = wait_for_vacancy(
        addr,
        int(port),
        int(label),
        timeout_s=max(30.0, cfg.fault_timeout_s * 3),
        sign=None if admitted is None else partial(admitted.sign, read_token(cfg.token_file), "spare"),
    )
    print(f"geotrain: {name} takes the place of host {host}", file=sys.stderr, flush=True)
    return replace(
        cfg, join=True, host=host, keeper=cfg.keeper.replace("{host}", str(host)),
        heartbeat=f"{addr}:{port}:{attempt}:{host}" if not cfg.broker else cfg.heartbeat,
    )  # fmt: skip


def broker_address(spec: str, host: int) -> str:
    """``ADDR:PORT`` checked, for ``--broker``; ``host`` must be given with it."""
    addr, _, port = spec.rpartition(":")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--broker takes ADDR:PORT (the broker's address and --port), got {spec!r}")
    if host < 0:
        raise ConfigError("--broker needs --host I, this machine's host id (0 .. the broker's --hosts - 1)")
    return f"{addr}:{port}"


def _leave(cfg: TrainConfig, heartbeat: Heartbeat | None, code: int) -> None:
    """Say goodbye to the coordinator and the launcher; skip the destructors of groups abandoned
    in a regroup (``ft.membership.RETIRED``), which could wait forever for a cut-off peer."""
    try:
        if heartbeat is not None:
            # Under continue, a trainer that failed says so (its host leaves at once: the
            # deathrattle on a real cluster, where no launcher watches its exit).
            # One declared failed (3) says nothing: a replacement may be that host by now.
            heartbeat.close(
                failed=cfg.elastic and code not in (0, 3, EXIT_BELOW_MIN_WORKERS), silent=code == 3
            )
            if cfg.elastic and cfg.run_dir:
                # torchrun's agent waits for its peers' agents at exit (300 s if one is gone):
                # the launcher takes the trainer's own word that it is done.
                with contextlib.suppress(OSError):
                    exit_file = Path(cfg.run_dir) / "control" / f"exit-{heartbeat.host}"
                    write_atomic(exit_file, f"{code}\n".encode())
    finally:
        if RETIRED:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _run_hosts(cfg: TrainConfig) -> int:
    """A joiner's or a broker run's first look at the coordinator, before this process beats as
    its host (a refused one must not speak for a host that is training): how many hosts the run
    started with. Refusals are ``ConfigError``s (exit 2), an absent coordinator ``RunFinished``."""
    addr, port, attempt, host = cfg.heartbeat.rsplit(":", 3)
    where, host = f"{addr}:{port}", int(host)
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        try:
            hosts, epoch, members = first_hosts(
                addr, int(port), timeout_s=30.0 if cfg.join else cfg.timeout_s
            )
        except Exception as e:  # a broker that is gone (the run is over) or never was
            raise RunFinished(f"no coordinator answers at {where} ({type(e).__name__})") from None
        if not 0 <= host < hosts:
            raise ConfigError(f"--host must be in [0, {hosts}) (the run's hosts), got {host}")
        if not cfg.join:
            if epoch > 0 or host_beating(addr, int(port), attempt, host, window_s=1.2):
                raise ConfigError(
                    f"host {host} is already training in this run (or the run is under way): a machine "
                    "that replaces a lost one joins with `geotrain join`"
                )
            return hosts
        if host not in members:
            if not cfg.spare and spare_placed(addr, int(port), host):
                raise ConfigError(f"a spare from the backup pool is taking host {host}'s place")
            return hosts
        # Still listed: either alive (refused) or just lost, its verdict to come (the broker's
        # --fault-timeout, which this process does not know): wait for it to leave.
        if host_beating(addr, int(port), attempt, host):
            raise ConfigError(
                f"host {host} is still training in this run; a replacement takes the place of a lost "
                f"host (members now: {members})"
            )
        if time.monotonic() > deadline:
            raise ConfigError(f"host {host} is silent but still a member after {cfg.timeout_s:g} s")
        time.sleep(0.5)


def _fatal(cfg: TrainConfig, rank: int, said: str, reason: str) -> None:
    """Say why this worker ends, and tell the launcher not to retry what fails the same way every
    time (bad input, a collective that outlasts its timeout): it ends the run with ``reason``."""
    print(said, file=sys.stderr)
    if cfg.run_dir:
        with contextlib.suppress(OSError):
            write_atomic(Path(cfg.run_dir) / "control" / f"fatal-rank{rank}", f"{reason}\n".encode())
