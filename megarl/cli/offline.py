"""``megarl sft`` and ``megarl dpo``: the offline trainers of :mod:`megarl.offline` (their arguments and runs live
there; this module registers them)."""

from __future__ import annotations

import argparse

from megarl.cli.args import command, split_config_and_overrides
from megarl.cli.world import relaunch_world


@command("sft", help="supervised fine-tuning on chat or prompt/completion data (megarl.offline)")
def _sft(p: argparse.ArgumentParser):
    from megarl.offline import command as offline

    offline.add_arguments(p)
    return lambda a: offline.run("sft", *split_config_and_overrides(a.config, a.overrides), a, relaunch_world)


@command("dpo", help="DPO on chosen/rejected pairs (megarl.offline)")
def _dpo(p: argparse.ArgumentParser):
    from megarl.offline import command as offline

    offline.add_arguments(p)
    return lambda a: offline.run("dpo", *split_config_and_overrides(a.config, a.overrides), a, relaunch_world)
