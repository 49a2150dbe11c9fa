"""``megarl submit`` and ``megarl sweep``: runs as SLURM jobs and grids of benchmarks (:mod:`megarl.launch`)."""

from __future__ import annotations

import argparse

from megarl.cli.args import command, split_config_and_overrides


@command("submit", help="a training run as one SLURM batch job (sbatch)")
def _submit(p: argparse.ArgumentParser):
    from megarl.launch import submit

    submit.add_arguments(p)

    def run(a: argparse.Namespace) -> int:
        a.config, a.overrides = split_config_and_overrides(a.config, a.overrides)
        return submit.run(a)
    return run


@command("sweep", help="a config over a grid of values: one benchmark per point, table, CSV and plot")
def _sweep(p: argparse.ArgumentParser):
    from megarl.launch import sweep

    sweep.add_arguments(p)
    return sweep.run
