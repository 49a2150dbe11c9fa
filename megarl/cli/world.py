"""Where a command runs: as one rank of a job (torchrun, srun) or as its launcher, which checks the config
(``--check`` alone, or before a run) and relaunches ``megarl`` under torchrun for a config of several ranks."""

from __future__ import annotations

import os
import sys
from typing import Callable


def relaunch_world(cfg, argv: list[str], *, run_folder: bool = False,
                   checks: Callable | None = None) -> bool:
    """Under torchrun or SLURM: False (this process is one rank). Started plainly: check ``cfg`` against its
    world size and its model (``checks(cfg, world_size) -> spec``; default :func:`megarl.trainer.preflight.
    preflight`), then, with ``run_folder``, that the run folder is free and its checkpoints fit the run; and when that is more than one rank, run ``megarl ARGV``
    under ``torchrun --nproc_per_node=<world size>`` on this node and return True once it has finished (its
    ranks end with this process, SIGKILL included: :mod:`megarl.parallel.lifecycle`).

    Raises:
        ConfigError: from :func:`~megarl.trainer.preflight.preflight`, naming the field, or from
            :func:`~megarl.trainer.checkpointing.check_run_folder`, before any process starts.
        RunLockedError: with ``run_folder``, another run owns the folder.
    """
    if is_rank():
        return False
    if checks is None:
        from megarl.trainer.preflight import preflight as checks

    spec = checks(cfg, cfg.world_size)  # first: a config error is named even while another run owns the folder
    if run_folder:
        from megarl.launch.memory import warn_host_memory
        from megarl.storage import check_writable
        from megarl.parallel.run_lock import check_free
        from megarl.trainer.checkpointing import check_run_folder

        check_free(cfg.run.run_dir)  # another run owns the folder
        check_writable(cfg.run.run_dir, "run.output_dir")  # a file in the way, a read-only or full file system
        check_run_folder(cfg, cfg.world_size)  # an earlier run's checkpoints, none to resume, a finished run
        warn_host_memory(cfg, spec, cfg.world_size)  # a GPU machine whose host will not hold a checkpoint save
    if cfg.world_size == 1:
        return False
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from megarl.parallel.lifecycle import mark_children

    mark_children()  # the ranks end with this process, SIGKILL included
    # each rank's threads: this machine's cores shared out (torchrun would set 1, with a banner saying so)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // cfg.world_size)))
    print(f"megarl: launching {cfg.world_size} processes with torchrun", flush=True)
    _quiet_torchrun_stop()
    try:
        torchrun([f"--nproc_per_node={cfg.world_size}", "--standalone", "-m", "megarl.cli", *argv])
    except SignalException:  # torchrun's agent got SIGINT/SIGTERM and has stopped the ranks
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        from megarl.parallel.restart import EXIT_REQUEUE, requeue_message, requeue_stop

        if requeue_stop(f.exitcode for f in e.failures.values()):  # saved on SIGUSR1: this launcher speaks for them
            from megarl.models.checkpoint import latest_checkpoint

            print(f"megarl: {requeue_message(latest_checkpoint(cfg.run.run_dir))}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_REQUEUE) from None
        failed = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in e.failures.items())
        print(f"megarl: error: megarl {argv[0]} failed on {failed}; see the ranks' messages above",
              file=sys.stderr)
        from megarl.parallel.restart import NOT_RETRIED

        # a rank's config, data or storage error keeps its status: a restart would fail again (launch.supervise)
        kept = [f.exitcode for f in e.failures.values() if f.exitcode in NOT_RETRIED]
        raise SystemExit(min(kept) if kept else 1) from None
    return True


def _quiet_torchrun_stop() -> None:
    """Drop torchrun's agent's lines about ranks ending: ``Sending process N closing signal SIGTERM`` (the ranks
    left once one has ended, always) and ``failed (exitcode: 75)`` (a stop for the requeue, not a failure):
    :func:`relaunch_world` says what happened in one line of its own."""
    import logging

    from megarl.parallel.restart import EXIT_REQUEUE

    def keep(record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("Sending process") and "closing signal" in msg:
            return False
        return not (msg.startswith("failed (exitcode:") and args[:1] == (EXIT_REQUEUE,))

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(keep)


def check_only(cfg, what: str, *, run_folder: bool = False) -> int:
    """``--check``: :func:`~megarl.trainer.preflight.preflight` of ``cfg`` without the checks of this machine
    (a GPU config checked on a CPU machine, as CI checks ``perf/gpu_*.sh``), and with ``run_folder`` what the
    run folder's checkpoints allow (:func:`~megarl.trainer.checkpointing.check_run_folder`, read only: a new run
    over an earlier run's checkpoints, a finished run, a checkpoint this config cannot resume). A ``--resume``
    whose folder holds no checkpoint yet is a warning on stderr, not a refusal: a script's earlier command may
    write it (``perf/gpu_resume.sh``, checked command by command). Prints one line; returns 0.

    Raises:
        ConfigError: naming the field, as a run would before starting.
    """
    from megarl.trainer.preflight import preflight

    spec = preflight(cfg, cfg.world_size, this_machine=False)
    if run_folder:
        from megarl.models.checkpoint import run_checkpoints
        from megarl.trainer.checkpointing import check_run_folder

        if cfg.trainer.resume and not run_checkpoints(cfg.run.run_dir):
            print(f"megarl {what}: warning: trainer.resume: the run folder {cfg.run.run_dir} holds no checkpoint "
                  "yet; the run would be refused unless one is written first (start it without --resume, or check "
                  "run.name and run.output_dir)", file=sys.stderr, flush=True)
        else:
            check_run_folder(cfg, cfg.world_size)
    print(f"megarl {what}: check passed ({cfg.world_size} rank(s), model {cfg.model.path}: {spec.num_layers} "
          f"layers, hidden {spec.hidden_size}); nothing was run", flush=True)
    return 0


def _rank() -> int:
    """This rank's global rank (torchrun's ``RANK``, srun's ``SLURM_PROCID``); 0 outside a job."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


def is_rank() -> bool:
    """Whether this process is one rank of a job (started by torchrun or SLURM), not a launcher."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ
