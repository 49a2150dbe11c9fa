"""The ``megarl sft`` and ``megarl dpo`` commands: their arguments and what they run.

    megarl sft CONFIG.yaml [key=value ...] [--resume] [--check]
    megarl dpo CONFIG.yaml [key=value ...] [--resume] [--check]

The config is a :class:`~megarl.config.offline.SFTRunConfig` / :class:`~megarl.config.offline.DPORunConfig`. As for
``megarl train``, everything is checked before any process starts (the config, the model, every data row, the
layout against the world, the run folder): bad input ends in one ``megarl: error:`` line. A config whose layout
needs several ranks relaunches itself under torchrun on this node (:func:`megarl.cli.world.relaunch_world`).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Callable

COMMANDS = {"sft": ("megarl.offline.sft", "SFTTrainer", "SFTRunConfig"),
            "dpo": ("megarl.offline.dpo", "DPOTrainer", "DPORunConfig")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The offline commands' arguments."""
    p.add_argument("config", nargs="?", help="YAML file; omitted: the defaults and the overrides alone")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.train_files=[chat.jsonl] "
                                                "actor.optim.lr=1e-5")
    p.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    p.add_argument("--check", action="store_true", help="check the config, model, data, layout and run folder, "
                                                        "print the result and run nothing")


def run(name: str, config: str | None, overrides: list[str], a: argparse.Namespace,
        relaunch_world: Callable) -> int:
    """Run ``megarl NAME`` (``config`` and ``overrides`` split from the positionals); returns the exit status.

    Raises:
        ConfigError / DataError: naming the field, or the file and row, before any process or model starts.
    """
    from megarl import config as config_module
    from megarl.offline.trainer import run as run_offline
    from megarl.trainer.checkpointing import check_run_folder

    module, trainer_name, schema = COMMANDS[name]
    trainer_cls = getattr(importlib.import_module(module), trainer_name)
    cfg = config_module.load_config(config, overrides + (["trainer.resume=true"] if a.resume else []),
                                    schema=getattr(config_module, schema))
    world = cfg.world_size
    prepared = trainer_cls.prepare(cfg, world)
    if a.check:
        check_run_folder(prepared.cfg, world)
        print(f"megarl {name}: check passed ({world} rank(s), {len(prepared.train)} training examples, "
              f"{prepared.cfg.trainer.steps} steps, model {cfg.model.path}); nothing was run", flush=True)
        return 0
    if relaunch_world(prepared.cfg, [name, *a.argv], run_folder=True, checks=lambda c, w: prepared.spec):
        return 0
    run_offline(trainer_cls, cfg, prepared)
    return 0
