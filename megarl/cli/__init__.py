"""The ``megarl`` command: one argparse tree of subcommands.

    megarl train [CONFIG.yaml] [key=value ...] [--resume]   RL training (no config: the CPU default)
    megarl convert SRC OUT [--tp T] [--pp P] [--vpp V] [--dtype D] [--overwrite]
                                                            HF directory / GGUF -> megarl checkpoint
    megarl export CKPT OUT [--overwrite]                    megarl checkpoint -> HF directory
    megarl data gsm8k --src DIR|hub --out DIR [--overwrite] prepare GSM8K parquet files
    megarl data arithmetic --out DIR [--overwrite]          write the arithmetic task's parquet files
    megarl data calculator --out DIR [--overwrite]          write the calculator task's parquet files
    megarl sft [CONFIG.yaml] [key=value ...] [--resume]     supervised fine-tuning (chat, prompt/completion)
    megarl dpo [CONFIG.yaml] [key=value ...] [--resume]     DPO on chosen/rejected pairs
    megarl eval MODEL [CONFIG.yaml] [key=value ...]         held-out accuracy of a model or checkpoint
    megarl report RUN_DIR [--overwrite]                     plots and a markdown page of a run
    megarl bench reshard ...                                reshard benchmark (see --help)
    megarl bench step [CONFIG.yaml] [key=value ...] --steps N --warmup K [--json PATH] [--overwrite]
                                                            RL step benchmark: per-phase tokens/s/GPU, MFU
    megarl bench gate REPORT.json --case NAME [--tolerance F] [--append]
                                                            speed gate: the report against its case's history
    megarl submit [CONFIG.yaml] [key=value ...] --nodes N --gpus-per-node G [--dry-run] [--resume]
                                                            a training run as one SLURM batch job
    megarl sweep SWEEP.yaml (--slurm | --local | --plan | --check) [--overwrite]
                                                            benchmark a grid of layouts (SLURM job array)

Each subcommand registers itself with :func:`~megarl.cli.args.command` (its arguments and the function that
runs it) in the module of its group: :mod:`~megarl.cli.train` (train, eval, report), :mod:`~megarl.cli.offline`
(sft, dpo), :mod:`~megarl.cli.models` (convert, export), :mod:`~megarl.cli.data`, :mod:`~megarl.cli.bench` and
:mod:`~megarl.cli.launch` (submit, sweep), each imported below in the order of ``megarl --help``'s list. A new command adds a ``@command`` function
to its group's module (a new group: a module, and its import below), not a parser of its own; the parts that
commands share are in :mod:`~megarl.cli.args` (the registry, argument types, help texts) and
:mod:`~megarl.cli.world` (rank or launcher, ``--check``, the torchrun relaunch). This module builds the tree
(:func:`build_parser`), runs a command (:func:`main`) and ends the process (:func:`entry`). Bad input ends in
one line, ``megarl: error: <what> ...``, naming the flag or config field, before any process or model starts.

``megarl train`` runs under torchrun or SLURM's srun as given; started plainly for a config whose mesh needs
several ranks, it relaunches itself with ``torchrun --nproc_per_node=<world size>`` on this node; those ranks
end with it, SIGKILL included (:mod:`megarl.parallel.lifecycle`), and a run folder has one run at a time
(:mod:`megarl.parallel.run_lock`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from megarl.cli.args import _COMMANDS, Interrupted, UsageError, _Parser, command  # noqa: F401 (megarl.cli.command)
from megarl.cli.world import _rank, is_rank

# each module registers its commands when imported, in the order of `megarl --help`'s list
from megarl.cli import train, offline, models, data, bench, launch  # noqa: F401,I001


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``megarl`` argument tree (every registered :func:`command`). With ``argv``, only the command that it
    names gets its arguments: a builder imports what its command needs, so ``megarl --help`` and ``megarl
    COMMAND --help`` import neither torch nor megatron-core (each builder keeps its imports light)."""
    usage = __doc__.split("\n\n")[1]  # the table of commands at the top of this module's docstring
    root = _Parser(prog="megarl", description="megarl: RL post-training (PPO, GRPO and kin) of LLMs on "
                   "Megatron-core TP/PP/DP meshes, with vLLM rollouts.",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog=f"{usage}\n\n`megarl COMMAND --help` gives a command's flags; README.md walks "
                   "through a first run.")
    root_sub = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {(): root_sub}
    for path, help_text, build in _COMMANDS:
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in groups:
                g = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} subcommands")
                groups[prefix] = g.add_subparsers(dest=f"command_{depth}", metavar="SUBCOMMAND", required=True,
                                                  parser_class=_Parser)
        p = groups[path[:-1]].add_parser(path[-1], help=help_text, description=help_text)
        if argv is None or list(path) == argv[:len(path)]:
            p.set_defaults(run=build(p))
    return root


def main(argv: list[str] | None = None) -> int:
    from megarl.parallel.lifecycle import bind_to_launcher, watch_interrupts

    bind_to_launcher()  # a rank (torchrun relaunch, torchrun, srun) ends with the process that started it
    watch_interrupts()
    if is_rank():
        from megarl.parallel.restart import watch_requeue_signal

        watch_requeue_signal()  # SIGUSR1 (SLURM, before the time limit): save after the step, then requeue
        import faulthandler

        faulthandler.enable()  # a rank that crashes in native code (SIGSEGV, SIGABRT) prints its Python stacks
    argv = list(sys.argv[1:] if argv is None else argv)
    from megarl.config import ConfigError
    from megarl.parallel.lifecycle import PeerLostError, interrupted
    from megarl.parallel.restart import EXIT_REQUEUE, EXIT_STORAGE, RequeueRequested
    from megarl.storage import StorageError, is_storage_fault
    from megarl.parallel.run_lock import RunLockedError

    try:
        parser = build_parser(argv)
        if not argv:
            parser.print_help()
            return 0
        args, extra = parser.parse_known_args(argv)
        if extra and isinstance(getattr(args, "overrides", None), list) and all(
                "=" in e and not e.startswith("-") for e in extra):
            args.overrides += extra  # overrides after a flag: `megarl train CONFIG --resume trainer.steps=N`
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        run = getattr(args, "run", None)
        if run is None:
            parser.print_help()
            return 0
        del args.run  # a command's namespace holds its flags alone, picklable (bench reshard sends it to its ranks)
        args.argv = argv[1:]
        from megarl.console import quiet_libraries, quiet_other_ranks
        from megarl.parallel.lifecycle import own_descendants

        own_descendants()  # what the command starts (libraries' helpers included) ends with it, kill -9 included
        quiet_libraries()
        if is_rank():
            quiet_other_ranks()
        return run(args)
    except (UsageError, ConfigError, ValueError, FileNotFoundError, RunLockedError) as e:  # errors naming the fix
        if os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e}", file=sys.stderr)  # every rank of a job says it: a rank that stayed silent
        return 2  # could be the one its launcher leaves standing, and the message would be lost
    except OSError as e:  # a full disk, a read-only folder, a file where a folder must be: one line, not retried
        if not is_storage_fault(e) or os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e if isinstance(e, StorageError) else _storage_line(e)}", file=sys.stderr, flush=True)
        return EXIT_STORAGE
    except (Interrupted, KeyboardInterrupt) as e:  # the user's Ctrl-C: no traceback, and how to go on
        return _interrupted(e)
    except RequeueRequested as e:  # SIGUSR1: saved; the job's supervisor requeues it
        from megarl.parallel.lifecycle import started_by_megarl

        if not (is_rank() and (started_by_megarl() or _rank() != 0)):  # one line: megarl's launcher's, or rank 0's
            print(f"megarl: {e}", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except PeerLostError as e:  # one rank's view of a failed job: what it lost, and where
        if interrupted():  # the peer stopped on the same Ctrl-C
            return _interrupted(e)
        if os.environ.get("MEGARL_TRACEBACK"):
            raise
        print(f"megarl: error: {e}", file=sys.stderr, flush=True)
        return 1


def _storage_line(e: OSError) -> str:
    """The message of a storage fault that megarl's code did not describe itself (:mod:`megarl.storage`)."""
    from megarl.storage import describe

    return (f"cannot write: {describe(e)}; free space or fix the folder, then run again (a training run continues "
            "from its newest checkpoint with --resume)")


def _interrupted(e: BaseException) -> int:
    """The exit of a command the user stopped: one line saying how to go on (from megarl's launcher alone
    when this is one of its ranks), status 130 (128 + SIGINT, as a shell reports it)."""
    from megarl.parallel.lifecycle import started_by_megarl

    if not started_by_megarl():
        print(f"megarl: interrupted{'; ' + str(e) if isinstance(e, Interrupted) else ''}", file=sys.stderr,
              flush=True)
    return 130


def end_process(status: int) -> NoReturn:
    """End a finished megarl process: destroy its process groups while the interpreter is whole, end every
    process it started (:func:`megarl.parallel.lifecycle.end_descendants`), flush its output, and leave with
    ``os._exit`` as :mod:`multiprocessing` ends its children, without interpreter teardown. Afterwards nothing
    holds its stdout or stderr: ``megarl train ... | cat`` ends with the run.

    Teardown destroys C++ objects of torch and gloo whose worker threads may still hold Python objects; on a
    loaded machine that aborted a finished rank now and then (``terminate called without an active
    exception``, exit code -6) after its work was done and written; and the helpers that libraries start and
    never stop (megatron-core's checkpoint writer's ``multiprocessing`` manager and its resource tracker) kept
    running after it, holding the output open. Everything megarl writes is closed before this (loggers,
    checkpoints, reports)."""
    import logging

    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    from megarl.parallel.lifecycle import end_descendants

    end_descendants()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that has gone (``| head``), a closed stream
            pass
    os._exit(status)


def entry() -> NoReturn:
    """The ``megarl`` command and ``python -m megarl.cli``: :func:`main`, then :func:`end_process` with its
    status; a crash (an exception that :func:`main` does not turn into a message) prints its traceback and ends
    with status 1, never 0."""
    try:
        status = main()
    except SystemExit as e:  # a status chosen on the way (relaunch_world's for its ranks' failure)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 (a crash: said in full, and a failed status whatever teardown does)
        import traceback

        traceback.print_exc()
        status = 1
    end_process(status)
