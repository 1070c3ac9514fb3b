"""Sync algorithms by name: ``build_sync("diloco", model, optimizer, comm, {"H": 10})``."""

from __future__ import annotations

from typing import Any

from geotrain.comm.communicator import Communicator
from geotrain.compress import NO_CODEC
from geotrain.compress.codec import make_codec
from geotrain.sync.base import ConfigError, SyncAlgorithm, SyncConfig
from geotrain.sync.co2 import CO2, CO2Config
from geotrain.sync.ddp import DDP, DDPConfig, DDPPowerSGD, DDPPowerSGDConfig
from geotrain.sync.demo import DeMo, DeMoConfig
from geotrain.sync.diloco import DiLoCo, DiLoCoConfig
from geotrain.sync.dreamddp import DreamDDP, DreamDDPConfig
from geotrain.sync.localsgd import LocalSGD, LocalSGDConfig
from geotrain.sync.nosync import NoSync, NoSyncConfig
from geotrain.sync.sparseloco import SparseLoCo, SparseLoCoConfig
from geotrain.sync.ssgd import SSGD, SSGDConfig
from geotrain.sync.streaming import StreamingConfig, StreamingDiLoCo

ALGORITHMS: dict[str, tuple[type[SyncAlgorithm], type[SyncConfig]]] = {
    "ssgd": (SSGD, SSGDConfig),
    "ddp": (DDP, DDPConfig),
    "ddp_powersgd": (DDPPowerSGD, DDPPowerSGDConfig),
    "localsgd": (LocalSGD, LocalSGDConfig),
    "diloco": (DiLoCo, DiLoCoConfig),
    "dreamddp": (DreamDDP, DreamDDPConfig),
    "sparseloco": (SparseLoCo, SparseLoCoConfig),
    "demo": (DeMo, DeMoConfig),
    "streaming": (StreamingDiLoCo, StreamingConfig),
    "co2": (CO2, CO2Config),
    "nosync": (NoSync, NoSyncConfig),
}


def sync_config(name: str, options: dict[str, Any] | None = None) -> SyncConfig:
    """Validate ``name`` and build its config from generic options (others' options are ignored)."""
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; accepted: {', '.join(ALGORITHMS)}")
    options = options or {}
    config_cls = ALGORITHMS[name][1]
    why_not = {"compress": "", "warm_start": " (it synchronises every step, or plans its own schedule)"}
    # Options of one algorithm, given only when set (0 is a value for some of them).
    why_not |= dict.fromkeys(("fragments", "tau", "mix", "gap_penalty", "clip", "pace", "site_H"), "")
    why_not |= dict.fromkeys(("fill_in", "lag", "mean_over", "momentum_ramp", "carry", "eager"), "")
    why_not["eager_weight"] = ""
    why_not["H_schedule"] = " (its period is fixed, or planned by itself)"
    # 0 (or False) is a value of these
    zero_given = ("tau", "clip", "mix", "fill_in", "lag", "momentum_ramp", "carry", "eager", "eager_weight")
    for option, why in why_not.items():
        value = options.get(option)
        given = value is not None if option in zero_given else bool(value)
        given = value not in (None, "steps") if option == "pace" else given
        if given and option not in config_cls.__dataclass_fields__:
            takers = [a for a, (_, c) in ALGORITHMS.items() if option in c.__dataclass_fields__]
            flag = "--" + option.replace("_", "-")
            raise ConfigError(f"{name} does not take {flag}{why}; algorithms that do: {', '.join(takers)}")
    if options.get("compress") == NO_CODEC:  # fp32 spelled out: for the config, as ""
        options = {**options, "compress": ""}
    if options.get("compress") == "auto":
        if not ALGORITHMS[name][0].chooses_codec:
            choosers = [a for a, (cls, _) in ALGORITHMS.items() if cls.chooses_codec]
            raise ConfigError(
                f"--compress auto lets a planner choose the codec, which {', '.join(choosers)} has and "
                f"{name} has not: name a codec (int8, int4, powersgd:rank=4, ...) or leave it out"
            )
    elif options.get("compress"):
        make_codec(options["compress"])  # a bad spec fails here, before any worker starts
    return config_cls.from_options(options)


def build_sync(
    name: str, model, optimizer, comm: Communicator, options: dict[str, Any] | None = None
) -> SyncAlgorithm:
    config = sync_config(name, options)
    return ALGORITHMS[name][0](model, optimizer, comm, config)


__all__ = ["ALGORITHMS", "ConfigError", "SyncAlgorithm", "build_sync", "sync_config"]
