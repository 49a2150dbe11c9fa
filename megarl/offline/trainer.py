"""The offline run on this rank (:class:`OfflineTrainer`): the actor's engine on its mesh, the examples and their
loader, validation, and the run's progress, driven by ``megarl train``'s own loop (:func:`megarl.trainer.loop.fit`:
metrics.jsonl, checkpoints every ``trainer.save_every`` steps, SIGUSR1 saves, the summary and report) and saved and
resumed by its :class:`~megarl.trainer.checkpointing.Checkpointer`. :mod:`.sft` and :mod:`.dpo` fill in the data
and the step.

An offline run is an RL run without a rollout: :func:`train_view` writes its section into the RL config's fields
that the loop, the layout checks and the checkpoints read (the rows per step as ``data.prompts_per_step`` and
``actor.ppo_mini_batch_size``, one sample per row, no reference pool, no RL validation, ``trainer.steps``), so a
checkpoint of it is a ``model.path`` for ``megarl train`` and resumes at any layout as an RL checkpoint does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from megarl.algos.kl import FixedKLController
from megarl.config import Config, ConfigError, absolute_paths, require
from megarl.config.offline import OfflineDataConfig
from megarl.models import checkpoint as ck
from megarl.models.hf_io import load_tokenizer
from megarl.models.spec import SpecError
from megarl.offline.data import Conversations, ExampleLoader, ExampleSet, read_source
from megarl.offline.policy import OfflinePolicy
from megarl.parallel.lifecycle import record_peers
from megarl.parallel.mesh import init_distributed, initialize_model_parallel, launch_info
from megarl.parallel.placement import build_pool_groups, global_layout, role_layouts, validate_for_world
from megarl.trainer.builders import model_meta, resolve_eos, seed_all
from megarl.trainer.checkpointing import Checkpointer
from megarl.trainer.preflight import tokenizer_source, validate_for_model
from megarl.trainer.run_state import RunState
from megarl.trainer.trainer import fit_in_run_folder
from megarl.workers.offload import RoleOffloads

log = logging.getLogger(__name__)


def train_view(cfg: Config, section: OfflineDataConfig, rows_per_step: int, steps: int) -> Config:
    """``cfg`` as the RL trainer's machinery reads it (module docstring): ``rows_per_step`` sequences per optimizer
    step, ``steps`` steps, sequences of up to ``section.max_length`` tokens, paths absolute."""
    return absolute_paths(dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, prompts_per_step=rows_per_step,
                                      max_prompt_length=section.max_length - 1),
        rollout=dataclasses.replace(cfg.rollout, n=1, engine="hf", max_new_tokens=1, tp=1, quantization=None),
        actor=dataclasses.replace(cfg.actor, ppo_mini_batch_size=rows_per_step, ppo_epochs=1),
        algorithm=dataclasses.replace(cfg.algorithm, name="reinforce_plus_plus",  # no groups, no critic
                                      kl=dataclasses.replace(cfg.algorithm.kl, coef=0.0)),
        validation=dataclasses.replace(cfg.validation, enabled=False),
        trainer=dataclasses.replace(cfg.trainer, steps=steps)))


class _Due:
    """When :func:`~megarl.trainer.loop.fit` validates: before the first step, after every ``every``-th and the
    last."""

    def __init__(self, every: int, what: str):
        self.every, self.what = every, what

    def due(self, step: int, steps: int) -> bool:
        return step in (0, steps) or bool(self.every and step % self.every == 0)

    def describe(self) -> str:
        return self.what


@dataclasses.dataclass
class Prepared:
    """What an offline run reads before any process group or model: its config as the trainer reads it
    (:func:`train_view`), the model's spec, the tokenizer, and the training and validation examples."""

    cfg: Config
    spec: Any
    tokenizer: Any
    tokenizer_source: str
    generation_config: dict | None
    train: list
    val: list | None


class OfflineTrainer:
    """One offline run on this rank (the interface :func:`~megarl.trainer.loop.fit` drives: ``step``,
    ``validate``, ``state``, ``checkpointer``, ``loader``). Subclasses set :attr:`section` (the config's
    section name), :attr:`rows_per_example`, and implement :meth:`examples`, :meth:`step` and :meth:`validate`.

    Args:
        prepared: :meth:`prepare` of the command's config.
    """

    section = ""
    rows_per_example = 1
    split_rollout = False  # what fit() asks of a run's rollout pool: an offline run has none

    @classmethod
    def prepare(cls, cfg: Config, world_size: int) -> Prepared:
        """Read and check everything an offline run needs before it starts processes: the model's spec and
        tokenizer, every data row (tokenised, masks made), the steps, the layout for ``world_size`` ranks.

        Raises:
            ConfigError / DataError: naming the field or the file and row.
        """
        sec: OfflineDataConfig = getattr(cfg, cls.section)
        source = None if cfg.model.path == "default" else cfg.model.path
        try:
            spec, _, tok = ck.source_spec(source)
        except (FileNotFoundError, SpecError) as e:
            raise ConfigError(f"model.path: {e}") from None
        tok_source = tokenizer_source(cfg, tok)
        tokenizer = load_tokenizer(tok_source)
        generation_config = ck.source_generation_config(source)
        spec = resolve_eos(spec, tokenizer, cfg.model.path, generation_config)
        require(sec.max_length <= spec.max_position_embeddings, f"{cls.section}.max_length",
                f"{sec.max_length} tokens exceed the model's context of {spec.max_position_embeddings}; use at most "
                f"{spec.max_position_embeddings}")
        conv = Conversations(tokenizer, sec.system_prompt, cls.section)
        train = cls.examples(read_source(sec.train_files, sec.dataset, sec.split, f"{cls.section}.train_files"),
                             conv, sec)
        val_rows = (read_source(sec.val_files, None, "", f"{cls.section}.val_files") if sec.val_files else
                    read_source([], sec.dataset, sec.val_split, f"{cls.section}.val_split")
                    if sec.dataset and sec.val_split else None)
        require(len(train) >= sec.batch_size, f"{cls.section}.batch_size",
                f"{sec.batch_size} is more than the {len(train)} training rows; lower it or add data")
        steps = sec.steps or sec.epochs * (len(train) // sec.batch_size)
        view = train_view(cfg, sec, sec.batch_size * cls.rows_per_example, steps)
        validate_for_world(view, world_size, warn=False)
        validate_for_model(view, spec)
        return Prepared(view, spec, tokenizer, tok_source, generation_config, train,
                        cls.examples(val_rows, conv, sec) if val_rows else None)

    def __init__(self, prepared: Prepared):
        p = prepared
        self.cfg = cfg = p.cfg
        self.sec = sec = getattr(cfg, self.section)
        self.spec, self.tokenizer, self.val = p.spec, p.tokenizer, p.val
        source = None if cfg.model.path == "default" else cfg.model.path
        info = init_distributed(timeout_s=cfg.trainer.timeout_s)
        record_peers()
        self.rank, self.world = info.rank, info.world_size
        self.run_dir = cfg.run.run_dir
        self.pad_id = p.spec.pad_token_id if p.spec.pad_token_id is not None else p.spec.eos_token_ids[0]
        per_epoch = len(p.train) // sec.batch_size
        self.loader = ExampleLoader(ExampleSet(p.train, str(sec.dataset or sec.train_files)), sec.batch_size,
                                    shuffle=sec.shuffle, seed=cfg.run.seed,
                                    epochs=max(1, math.ceil(cfg.trainer.steps / per_epoch)))
        layouts = role_layouts(cfg, self.world)
        self.mesh = global_layout(layouts, self.world, cfg.actor.parallel.ep)
        initialize_model_parallel(self.mesh, seed=cfg.run.seed, timeout_s=cfg.trainer.timeout_s)
        pools = build_pool_groups(layouts, self.world, self.mesh.ep)
        self.actor = OfflinePolicy(p.spec, pools["actor"].mesh, "actor", source, ck.DTYPES[cfg.model.dtype],
                                   cfg.actor, trainable=True, total_updates=cfg.trainer.steps, temperature=1.0,
                                   pool=pools["actor"], seed=cfg.run.seed)
        self.validation = _Due(sec.val_every, f"{len(self.val)} held-out rows") if self.val else None
        self.state = RunState(self.loader, FixedKLController(0.0))
        self.checkpointer = Checkpointer(cfg, actor=self.actor, critic=None, pools=pools,
                                         rollout_ranks=tuple(range(self.world)), offloads=RoleOffloads([self.actor]),
                                         model_meta=model_meta(cfg, p.spec, p.tokenizer_source,
                                                               ck.source_config(source), p.generation_config))
        if cfg.trainer.resume:
            self.checkpointer.resume(self.state)

    @property
    def seq_multiple(self) -> int:
        """Sequence padding of a batch (the RL trainer's: tensor-parallel sequence sharding, CP's chunks)."""
        return 8 * self.mesh.tp * self.mesh.cp

    def chunks(self, examples: list) -> list[tuple[list, int]]:
        """``examples`` in chunks of a step's size, the last one filled up with copies of the first examples:
        ``(chunk, real)`` with ``real`` the chunk's examples that count (forward passes need whole steps: every
        DP rank a share of the same size)."""
        size = self.sec.batch_size
        out = []
        for lo in range(0, len(examples), size):
            part = examples[lo:lo + size]
            out.append((part + [examples[k % len(examples)] for k in range(size - len(part))], len(part)))
        return out

    @classmethod
    def examples(cls, rows: list[tuple[str, dict]], conv: Conversations, sec: OfflineDataConfig) -> list:
        """The examples of ``rows`` (the command's data: :mod:`megarl.offline.data`)."""
        raise NotImplementedError

    def step(self, examples: list, more=None) -> dict[str, Any]:
        """One optimizer step on a batch of examples (``more``: unused, the RL loop's extra prompts); returns
        its metrics, identical on every rank."""
        raise NotImplementedError

    def validate(self) -> dict[str, Any]:
        """The ``val/`` metrics of the current weights on the validation examples."""
        raise NotImplementedError

    def step_seed(self) -> int:
        """The mini-batch shuffle's seed of the next step (the RL trainer's)."""
        return self.cfg.run.seed * 7919 + self.state.step


def run(trainer_cls: type[OfflineTrainer], cfg: Config, prepared: Prepared | None = None) -> dict[str, Any]:
    """Run an offline command on this rank (every rank of the job calls it), as
    :func:`megarl.trainer.trainer.train` runs ``megarl train``: rank 0 holds the run folder's lock; the run
    folder's checkpoints must fit (a new run, or ``--resume``). ``prepared``: :meth:`OfflineTrainer.prepare` of
    ``cfg`` for ``cfg.world_size`` ranks where the caller has it (used where that is this job's world). Returns
    the summary.

    Raises:
        ConfigError / DataError: the config, the data or the run folder, before any model is built.
        RunLockedError: another run owns the run folder (rank 0).
        PeerLostError: a collective failed because a peer died or stalled.
    """
    seed_all(cfg.run.seed)
    if prepared is None or launch_info().world_size != cfg.world_size:
        prepared = trainer_cls.prepare(cfg, launch_info().world_size)
    return fit_in_run_folder(prepared.cfg, lambda: trainer_cls(prepared))
