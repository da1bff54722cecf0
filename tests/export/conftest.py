"""The tools' own parsers, set up for a one-process test that stands in for a whole cluster."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


class DataParallel:
    """The ``mpu`` DeepSpeed asks for the data-parallel world size (a model-parallel unit)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        return 0


@pytest.fixture
def ds_parse(monkeypatch):
    """``DeepSpeedConfig(cfg, mpu)`` for a chosen world size, in this process.

    DeepSpeedConfig first asks ``deepspeed.comm.get_rank()``; without a process group that
    fails and it silently assumes world size 1, ignoring the mpu. Answering rank 0 (for this
    test only) lets it read the world size from the mpu and check the batch arithmetic.
    """
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)

    def parse(cfg: dict, world_size: int):
        return DeepSpeedConfig(copy.deepcopy(cfg), mpu=DataParallel(world_size))

    return parse


_TA_CLASSES: dict[int, type] = {}


def training_arguments_at(world_size: int):
    """``TrainingArguments`` reporting ``world_size`` processes, as it would under the real launch.

    transformers derives the global batch it checks against ds_config.json from the number of
    processes; a one-process test has one, so the plan's count is given here instead.
    """
    if world_size not in _TA_CLASSES:
        from transformers import TrainingArguments

        _TA_CLASSES[world_size] = type(
            f"TrainingArgumentsAt{world_size}", (TrainingArguments,), {"world_size": property(lambda self: world_size)}
        )
    return _TA_CLASSES[world_size]


@dataclass
class Launch:
    """What ``accelerate launch --config_file F train.py`` makes of a config file, without running it."""

    config: Any  # accelerate's ClusterConfig
    args: Any  # the processed launch arguments
    env: dict[str, str]  # the environment the launched processes get
    unknown_keys: list[str]  # section keys no launch option reads (typos)


@pytest.fixture(scope="session")
def launch_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions}


@pytest.fixture
def accelerate_launch(monkeypatch, launch_options):
    """Load a config file with accelerate's loader and run ``accelerate launch``'s argument
    processing and environment preparation on it (pure functions; nothing is started)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    def launch(path: Path) -> Launch:
        monkeypatch.chdir(path.parent)
        config = load_config_from_file(str(path))
        unknown = [k for k in config.deepspeed_config if k not in launch_options]
        unknown += [
            k if k.startswith("fsdp") else "fsdp_" + k
            for k in config.fsdp_config
            if (k if k.startswith("fsdp") else "fsdp_" + k) not in launch_options
        ]
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, defaults, mp_from_config = _validate_launch_command(args)
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            env = prepare_multi_gpu_env(args)
        else:
            _, env = prepare_simple_launcher_cmd_env(args)
        env = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
        return Launch(config, args, env, unknown)

    return launch


@pytest.fixture
def launched_env(monkeypatch):
    """Set a launch environment for the duration of one test (accelerate's plugins read it)."""

    def apply(env: dict[str, str]) -> None:
        for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return apply
