"""`--devices N`: a command's code split over N devices of this machine - one process per device (ranks.py), rank
0 running the code, the others following its model loads and calls (lockstep.py). Under torchrun, the processes
torchrun started are the ranks."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from npuport.devices import DeviceGraph, is_cpu
from npuport.runtime.config import load_config
from npuport.runtime.expert_parallel import ExpertShard
from npuport.runtime.loader import load_model
from npuport.runtime.lockstep import driving, follow
from npuport.runtime.parallel import Parallel, local_config
from npuport.runtime.ranks import RankInfo, from_torchrun, leave_group, run_on_ranks


def on_devices(target: Callable, args: tuple, devices: int, device_kind: str | None) -> Any:
    """target(*args) with every model it loads split over `devices` devices of kind device_kind (default: as
    npuport.devices picks); returns what target returns (picklable). One device: a plain call. Under torchrun,
    over torchrun's processes (`devices` is not used): rank 0 returns target's result, the others None."""
    info = from_torchrun(device_kind)
    if info is not None:
        try:
            result = _rank_main(info, target, args)
        except BaseException:
            DeviceGraph.release_all()
            dist.destroy_process_group()
            raise
        leave_group()
        return result
    if devices == 1:
        return target(*args)
    return run_on_ranks(_rank_main, (target, args), devices, device_kind)


def check_split(model_dir: Path, devices: int) -> None:
    """Raise NpuportError, before any process starts, when the model in model_dir cannot be split over `devices`
    ranks (heads, channels or experts that do not divide)."""
    if devices == 1:
        return
    config = load_config(Path(model_dir))
    local_config(config, Parallel(0, devices))
    if config.is_moe:
        ExpertShard(config.num_experts, devices)


def _rank_main(info: RankInfo, target: Callable, args: tuple) -> Any:
    if is_cpu(info.device):  # the ranks share the host's cores: a full thread pool each would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world))
    parallel = Parallel.from_default_group()
    if info.is_first:
        with driving(parallel):
            return target(*args)
    follow(load_model.__wrapped__, parallel, info.device)
    return None
