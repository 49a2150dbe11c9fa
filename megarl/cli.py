"""The ``megarl`` command.

    megarl train [CONFIG.yaml] [key=value ...] [--resume]   RL training (no config: the CPU default)
    megarl convert SRC OUT [--tp T] [--pp P] [--dtype D]    HF directory / GGUF -> megarl checkpoint
    megarl export CKPT OUT                                  megarl checkpoint -> HF directory
    megarl data gsm8k --src DIR|hub --out DIR               prepare GSM8K parquet files
    megarl bench reshard ...                                reshard benchmark (see --help)

``megarl train`` runs under torchrun or SLURM's srun as given; started plainly for a config whose mesh needs
several ranks, it relaunches itself with ``torchrun --nproc_per_node=<world size>`` on this node.
"""

from __future__ import annotations

import os
import sys


def _train(argv: list[str]) -> int:
    import argparse

    from megarl.config import load_config, validate_for_world

    p = argparse.ArgumentParser(prog="megarl train", description="RL post-training (PPO, GRPO, RLOO, REINFORCE++)")
    p.add_argument("config", nargs="?", help="YAML file (parallel_configs/...); omitted: the CPU default")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=2 actor.optim.lr=1e-6")
    p.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    a = p.parse_args(argv)
    if a.config and "=" in a.config:  # only overrides given
        a.overrides.insert(0, a.config)
        a.config = None
    overrides = list(a.overrides) + (["trainer.resume=true"] if a.resume else [])
    cfg = load_config(a.config, overrides)  # fails here, before any process or model, on a bad config
    launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    if not launched:
        validate_for_world(cfg, cfg.world_size)
    if not launched and cfg.world_size > 1:
        from torch.distributed.run import main as torchrun

        args = [f"--nproc_per_node={cfg.world_size}", "--standalone", "-m", "megarl.cli", "train", *argv]
        print(f"megarl: launching {cfg.world_size} processes with torchrun", flush=True)
        torchrun(args)
        return 0
    from megarl.trainer.trainer import train

    train(cfg)
    return 0


def _data(argv: list[str]) -> int:
    if not argv or argv[0] != "gsm8k":
        print("usage: megarl data gsm8k --src DIR|hub --out DIR", file=sys.stderr)
        return 2
    from megarl.data.gsm8k import main

    return main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from megarl.console import quiet_libraries

    quiet_libraries()
    try:
        return _dispatch(argv)
    except (ValueError, FileNotFoundError) as e:  # config, spec, data and layout errors name the fix
        if os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return _train(rest)
    if cmd == "convert":
        from megarl.models.convert import main_convert

        return main_convert(rest)
    if cmd == "export":
        from megarl.models.convert import main_export

        return main_export(rest)
    if cmd == "data":
        return _data(rest)
    if cmd == "bench" and rest[:1] == ["reshard"]:
        from megarl.bench.reshard import main as bench_reshard

        return bench_reshard(rest[1:])
    print(f"megarl: unknown command {' '.join(argv[:2])!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
