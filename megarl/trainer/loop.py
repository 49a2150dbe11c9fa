"""The run's loop, top to bottom: :func:`fit` validates before step 1, runs
:meth:`~megarl.trainer.trainer.Trainer.step` until ``trainer.steps`` with validation, metrics and checkpoints
between steps, and ends with the summary and report; :func:`fit_split` is the loop of a rollout pool of its own
(both groups of ranks walk one :func:`~megarl.trainer.pipeline.schedule`). ``trainer`` is the run's
:class:`~megarl.trainer.trainer.Trainer` throughout; the run's progress is its ``state`` (a
:class:`~megarl.trainer.run_state.RunState`), which the loop advances and hands to the checkpoints.

A step's metrics are logged before its checkpoint is written (a crash in the save loses no step's metrics);
after a step every rank agrees on whether to save (``trainer.save_every``, ``trainer.save_every_min``, the last
step, SIGUSR1) in one small all-reduce, and a SIGUSR1 ends the run after its save for the requeue.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.agents.rollout import gather_episodes
from megarl.config import Config, to_dict
from megarl.parallel.placement import share_object
from megarl.parallel.restart import RequeueRequested, read_restarts, requeue_message, requeue_requested
from megarl.parallel.watchdog import progress_watched
from megarl.trainer.metrics import MetricsLogger, read_metrics, summary_text
from megarl.parallel.in_flight import NewWeights, announce, flag_source
from megarl.trainer.pipeline import schedule
from megarl.trainer.run_record import cut_record_back, keep_earlier_record
from megarl.trainer.run_state import RunState

log = logging.getLogger(__name__)


def fit(trainer) -> dict[str, Any]:
    """Run until ``trainer.steps``; returns the summary (also printed and written to summary.json). A run that
    starts at step 0 first moves an earlier run's record aside (:func:`~megarl.trainer.run_record.
    keep_earlier_record`); a resumed one cuts its record back to its checkpoint's step
    (:func:`~megarl.trainer.run_record.cut_record_back`)."""
    cfg, state = trainer.cfg, trainer.state
    start = time.perf_counter()
    if trainer.rank == 0:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        if state.step == 0:  # first: the logger opens its files
            keep_earlier_record(trainer.run_dir)
        else:  # resumed: the steps after the checkpoint are logged again
            cut_record_back(trainer.run_dir, state.step)
    logger = MetricsLogger(trainer.run_dir / "metrics.jsonl", cfg.trainer.steps, state.step,
                           enabled=trainer.rank == 0, progress=cfg.trainer.progress, loggers=cfg.trainer.loggers,
                           config=to_dict(cfg), kind=getattr(trainer, "section", "") or "rl")  # offline: sft, dpo
    if trainer.rank == 0:
        (trainer.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
    batches = iter(trainer.loader)
    more_prompts = functools.partial(next, batches)
    first_step = state.step
    state.saved_at = time.monotonic()
    save_s = None  # the last checkpoint's seconds, reported with the next step
    try:
        if trainer.split_rollout:  # validation is refused there (check_rollout_pool)
            for step, metrics in fit_split(trainer, batches):
                logger.log(step, metrics)
        else:
            with progress_watched(cfg.trainer.timeout_s):  # a rank stalled outside a collective ends the run
                if state.step == 0 and _validation_due(trainer):
                    logger.log(0, trainer.validate())
                while state.step < cfg.trainer.steps:
                    metrics = trainer.step(next(batches), more_prompts)
                    state.step += 1
                    if _validation_due(trainer):
                        metrics.update(trainer.validate())
                    requeue, save = checkpoint_due(cfg, state)
                    if save_s is not None:  # the last checkpoint's seconds, saved after the step before
                        metrics["time/checkpoint_save"], save_s = save_s, None
                    logger.log(state.step, metrics)  # first: a crash in the save loses no step's metrics
                    if save:
                        start_save = time.perf_counter()
                        trainer.checkpointer.save(state)
                        save_s = time.perf_counter() - start_save
                    if requeue and state.step < cfg.trainer.steps:
                        raise _requeue_error(state)
    finally:
        logger.close()
    return _finish(trainer, time.perf_counter() - start, first_step)


def _finish(trainer, wall_s: float, first_step: int) -> dict[str, Any]:
    """The end of a run: the HF export (``trainer.export_hf``), the summary (printed and written to
    ``summary.json``, rank 0) and ``report.md``; returns the summary."""
    cfg, state = trainer.cfg, trainer.state
    hf_path = None
    if cfg.trainer.export_hf and state.last_checkpoint is not None:
        dist.barrier()
        if trainer.rank == 0:
            from megarl.models.convert import export_rank
            from megarl.parallel.launch import run_world

            hf_path = Path(run_world(export_rank, 1, str(state.last_checkpoint), str(trainer.run_dir / "hf"))[0])
    history = read_metrics(trainer.run_dir / "metrics.jsonl") if trainer.rank == 0 else []
    text = summary_text(history, run_dir=trainer.run_dir, checkpoint=state.last_checkpoint, hf_export=hf_path,
                        wall_s=wall_s, steps_this_session=state.step - first_step,
                        validation=trainer.validation.describe() if trainer.validation else None,
                        notes=_resume_notes(trainer.run_dir, state))
    summary = {"run_dir": str(trainer.run_dir), "checkpoint": str(state.last_checkpoint), "steps": state.step,
               "hf_export": str(hf_path) if hf_path else None, "last": history[-1] if history else None,
               "resumed": state.resumed, "restarts": read_restarts(trainer.run_dir)}
    if trainer.rank == 0:
        print(text, flush=True)
        (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.trainer.report:
            _write_report(trainer)
    return summary


def fit_split(trainer, batches, steps: int | None = None):
    """The steps with the rollout on a pool of its own, up to ``steps`` (default ``trainer.steps``): both
    groups of ranks walk one :func:`~megarl.trainer.pipeline.schedule` (``trainer.mode``: sync is k = 0,
    async k = ``trainer.max_staleness``), each doing its part of every event, and checkpoint where it says
    (``trainer.save_every``, the last step) or where :func:`checkpoint_due` finds it due after a step (every
    rank asks, both pools: ``trainer.save_every_min``, SIGUSR1). After a save on SIGUSR1 the run ends with
    :class:`~megarl.parallel.restart.RequeueRequested`. A checkpoint holds the batches generated ahead (async)
    and handed over by then; a resume (``state.in_flight``) trains on them instead of generating them
    again, so it walks the rest of the uninterrupted run's schedule (:mod:`megarl.trainer.pipeline`).

    Args:
        batches: the prompt loader's iterator; the rollout ranks draw a batch when they generate it, the
            training ranks when they train on it (so the data position saved is the steps trained; on resume
            the rollout ranks skip the batches in flight).

    Yields:
        ``(step, metrics)`` after each step's events (the metrics on the training ranks; ``{}`` on the
        rollout ranks), with ``state.step`` advanced.

    Raises:
        RequeueRequested: after the checkpoint of a step during which a rank got SIGUSR1.
    """
    cfg, t, state = trainer.cfg, trainer.timer, trainer.state
    k = cfg.trainer.max_staleness if cfg.trainer.mode == "async" else 0
    generating = trainer.engine is not None
    ready: dict[int, tuple[Any, int]] = {}  # step -> (its samples, the version that generated them)
    end = cfg.trainer.steps if steps is None else steps
    # a resume's batches in flight, as many as this run's k keeps (a smaller k: the later ones generated again)
    flight, state.in_flight = state.in_flight, {}
    restored = []
    for s in range(state.step + 1, min(state.step + k, end) + 1):
        if s not in flight:
            break
        restored.append(s)
        if generating:
            next(batches)  # drawn and generated before the save
        else:
            ready[s] = flight[s]
    source = flag_source(trainer.world, trainer.rollout_ranks)
    for step, events in schedule(state.step, end, k, lambda s: steps is None and save_due(cfg, s),
                                 in_flight=len(restored)):
        step_start = time.perf_counter()
        busy, stats, metrics, trained = {"train": 0.0, "rollout": 0.0}, None, {}, None
        save = False
        events = in_flight_order(events, step) if cfg.trainer.in_flight_updates else events
        new_weights, local = None, {}  # the step's weights taken in flight; the episodes generated meanwhile
        for e in events:
            if e.kind == "reshard" and new_weights is not None and e.step == step:  # the rollout ranks' side
                new_weights.finish()
                for j, (out, version) in local.items():
                    ready[j] = (gather_episodes(out, out.n, trainer.rollout_group), version)
                state.policy_version = e.step
            elif e.kind == "reshard":
                with t("reshard"):
                    stats = trainer.reshard_actor_to_engine()
                state.policy_version = e.step
            elif e.kind == "generate" and generating and in_flight_due(events, e, step, cfg):
                new_weights = new_weights or NewWeights(step, source, trainer.reshard_actor_to_engine)
                local[e.step] = (trainer.generate(next(batches), 0, e.step, pause=new_weights, gather=False),
                                 state.policy_version)
            elif e.kind == "generate" and generating:
                ready[e.step] = (trainer.generate(next(batches), 0, e.step), state.policy_version)
            elif e.kind == "batch":  # the rollout pool's first rank hands the samples to every rank
                with t("wait_rollout"):
                    got = share_object(ready.pop(e.step, None), trainer.rollout_ranks[:1])
                busy["rollout"] += got[0].stats.seconds
                if not generating:
                    ready[e.step] = got
            elif e.kind == "train":
                if not generating:
                    out, version = ready.pop(e.step)
                    start = time.perf_counter()
                    metrics, batch = trainer.train_on(next(batches), out, version)
                    busy["train"] = time.perf_counter() - start
                    trained = (batch, out)
                    if any(in_flight_due(events, g, step, cfg) for g in events):  # the weights follow at once
                        announce(trainer.rollout_ranks, source)
                state.step = e.step
            elif e.kind == "save":  # the step's last event
                save = True
        requeue = False
        if steps is None:  # a world-wide meeting after every step: a save by time or on SIGUSR1
            requeue, due = checkpoint_due(cfg, state)
            save = save or due
        if save:  # after the step's timings (a colocated step's exclude it too)
            metrics = _split_step_metrics(trainer, metrics, trained, stats, busy, step_start)
            trainer.checkpointer.save(state, None if generating else ready)
        yield step, _split_step_metrics(trainer, metrics, trained, stats, busy, step_start)
        if requeue and state.step < end:
            raise _requeue_error(state)


def in_flight_order(events: list, step: int) -> list:
    """A step's events with in-flight updates (:mod:`megarl.parallel.in_flight`): where the step sends its weights
    (``reshard step``), it does so right after its update, before the hand-overs of the batches generated
    meanwhile (whose episodes took them between turns)."""
    out = [e for e in events if (e.kind, e.step) != ("reshard", step)]
    if len(out) == len(events):
        return events
    at = next(i for i, e in enumerate(out) if e.kind == "train") + 1
    return out[:at] + [next(e for e in events if (e.kind, e.step) == ("reshard", step))] + out[at:]


def in_flight_due(events: list, event, step: int, cfg: Config) -> bool:
    """Whether ``event`` (of ``step``'s ``events``) generates episodes that take the step's weights in flight:
    ``trainer.in_flight_updates``, a batch of a later step generated while ``step`` trains, and the step sends
    its weights (``reshard step``)."""
    return (cfg.trainer.in_flight_updates and event.kind == "generate" and event.step > step
            and any((e.kind, e.step) == ("reshard", step) for e in events))


def _split_step_metrics(trainer, metrics: dict[str, Any], trained, stats, busy: dict[str, float],
                        step_start: float) -> dict[str, Any]:
    """:func:`fit_split`'s metrics of a step with its timings (once; the training ranks only)."""
    if "time/step" in metrics:
        return metrics
    if trained is None:  # a rollout rank: nothing to report, its phase timers start again
        trainer.timer.reset(), trainer.timer.reset_peaks()
        return metrics
    return {**metrics, **trainer.timing_metrics(*trained, stats, busy, time.perf_counter() - step_start)}


def checkpoint_due(cfg: Config, state: RunState) -> tuple[bool, bool]:
    """``(requeue, save)`` after a step, the same on every rank: whether any rank got SIGUSR1 (save, then
    end for a requeued job: :mod:`megarl.parallel.restart`), and whether to checkpoint now (every
    ``trainer.save_every`` steps, ``trainer.save_every_min`` minutes after the last save, at the last step,
    or on SIGUSR1). One small all-reduce: the ranks' clocks and signals may differ."""
    tc = cfg.trainer
    by_time = bool(tc.save_every_min) and time.monotonic() - state.saved_at >= 60 * tc.save_every_min
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    flags = torch.tensor([float(requeue_requested()), float(by_time)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    requeue, by_time = bool(flags[0]), bool(flags[1])
    return requeue, save_due(cfg, state.step) or by_time or requeue


def save_due(cfg: Config, step: int) -> bool:
    """Whether ``trainer.save_every`` or the last step calls for a checkpoint after ``step``."""
    every = cfg.trainer.save_every
    return bool(every and step % every == 0) or step == cfg.trainer.steps


def _validation_due(trainer) -> bool:
    return trainer.validation is not None and trainer.validation.due(trainer.state.step, trainer.cfg.trainer.steps)


def _requeue_error(state: RunState) -> RequeueRequested:
    return RequeueRequested(requeue_message(state.last_checkpoint))


def _resume_notes(run_dir: Path, state: RunState) -> list[str]:
    """Summary lines: the restarts of the run (``restarts.jsonl``) and what this session's resume changed."""
    notes = [f"{'restart ' + str(r.get('restart')):<19}{r.get('time')}: {r.get('reason')} (from "
             f"{Path(r['checkpoint']).name if r.get('checkpoint') else 'step 0'})"
             for r in read_restarts(run_dir)]
    if state.resumed:
        changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in state.resumed["changed"].items()) or "nothing"
        notes.append(f"{'resumed':<19}at step {state.resumed['step']}; config changed: {changed}")
    return notes


def _write_report(trainer) -> None:
    """``report.md`` and its plots in the run folder (:mod:`.report`; skipped without matplotlib), replacing the
    report of this run's earlier attempt (an earlier run's was moved to ``earlier/`` when this one started)."""
    try:
        from megarl.trainer.report import write_report
    except ImportError as e:
        log.warning("no report written (%s): pip install 'megarl[report]' for matplotlib", e)
        return
    print(f"report: {write_report(trainer.run_dir, overwrite=True)}", flush=True)
