"""reasoning-gym's procedural tasks (PyPI ``reasoning-gym==0.1.25``) as megarl data and reward, named by the
library's own task names.

Data (``data.prepare=reasoning_gym``): ``data.prepare_kwargs`` names the tasks and
the size::

    data:
      train_files: [data/reasoning_gym/train.parquet]
      prepare: reasoning_gym
      prepare_kwargs:
        tasks: [basic_arithmetic, letter_counting]     # or one name, or {name: weight | {weight, config}}
        size: 2000                                     # training rows
        test_size: 64                                  # test rows (validation.files: .../test.parquet)
        seed: 0
    reward: {fn: reasoning_gym}

One task is ``reasoning_gym.create_dataset(name, seed=seed, size=test_size + size, **config)``; several are its
composite dataset (``create_dataset("composite", ...)``: each row drawn from a task by the weights, each task
seeded from ``seed`` as reasoning-gym seeds them). Rows ``0 .. test_size - 1`` are the test split, the rest the
training split (no row in both). Columns: ``index``, ``question`` (the task's question as it words it),
``ground_truth`` (JSON ``{"spec": <the normalised kwargs>, "index": <row in the dataset>}``: what the reward
regenerates the entry from), ``task`` (the row's task: the per-task figures ``reward/<task>/mean`` and
``reward/<task>/accuracy``) and ``answer`` (the oracle's, for reading).

Reward (``reward.fn=reasoning_gym``, declared in :mod:`megarl.rewards`): the entry regenerated from the ground
truth (reasoning-gym's datasets are deterministic per ``(seed, index)``) and the response scored by the dataset's
own ``score_answer(answer, entry)``: for most tasks 1 for the exact answer, ``len(answer) / len(response)``
where the response holds it (dense, without a format to learn), 0 otherwise. ``answer_tag`` ("answer" for
reasoning-gym's own ``<answer>...</answer>`` convention, :func:`reasoning_gym.utils.extract_answer`) scores the
tag's content instead of the whole response; "" (the default) scores the response stripped.

Errors before any process starts (:func:`normalise_kwargs`, called by the preflight): a task name reasoning-gym
does not have (the close names listed), a config its task refuses, a size below 1, and files in the folder that
were generated from other settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from megarl.config import ConfigError
from megarl.data.dataset import read_rows, write_splits
from megarl.environments import import_package
from megarl.rewards.registry import RewardError

PACKAGE = "reasoning-gym==0.1.25"
FIELD = "data.prepare_kwargs"
SPLITS = ("train", "test")


def _rg(field: str = FIELD, error: type[Exception] = ConfigError):
    return import_package("reasoning_gym", PACKAGE, field, error)


def normalise_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``data.prepare_kwargs`` checked against reasoning-gym and written out in full: ``{"tasks": {name:
    {"weight": float, "config": dict}}, "size": int, "test_size": int, "seed": int}`` (``tasks`` in the order
    given), every task's dataset built once with its config.

    Raises:
        ConfigError: naming the field: reasoning-gym missing, no tasks, an unknown task (with the close names), a
            weight <= 0, a config its task refuses, sizes or seed out of range, other keys.
    """
    rg = _rg()
    extra = sorted(set(kwargs) - {"tasks", "size", "test_size", "seed"})
    if extra:
        raise ConfigError(f"{FIELD}: unknown keys {extra}; reasoning_gym takes tasks, size, test_size and seed")
    tasks = kwargs.get("tasks")
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(tasks, (list, tuple)):
        tasks = {name: 1.0 for name in tasks}
    if not isinstance(tasks, Mapping) or not tasks:
        raise ConfigError(f"{FIELD}.tasks: name reasoning-gym tasks (a name, a list, or name -> weight or "
                          f"{{weight, config}}), got {tasks!r}")
    size, test_size, seed = kwargs.get("size", 1000), kwargs.get("test_size", 64), kwargs.get("seed", 0)
    for key, value, low in (("size", size, 1), ("test_size", test_size, 0), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{FIELD}.{key}: must be an integer >= {low}, got {value!r}")
    known = sorted(name for name in rg.factory.DATASETS if name != "composite")
    out: dict[str, dict[str, Any]] = {}
    for name, task in tasks.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=5, cutoff=0.6)
            raise ConfigError(f"{FIELD}.tasks: reasoning-gym has no task {name!r}; "
                              + (f"did you mean one of {close}?" if close else f"its {len(known)} tasks: {known}"))
        task = {"weight": task} if not isinstance(task, Mapping) else dict(task)
        if set(task) - {"weight", "config"}:
            raise ConfigError(f"{FIELD}.tasks.{name}: takes weight and config, got {sorted(task)}")
        weight, config = task.get("weight", 1.0), dict(task.get("config") or {})
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise ConfigError(f"{FIELD}.tasks.{name}.weight: must be a number > 0, got {weight!r}")
        try:
            rg.create_dataset(name, **config, **({} if "size" in config else {"size": 1}))
        except (TypeError, ValueError, AssertionError) as e:
            fields = [f.name for f in dataclasses.fields(rg.factory.DATASETS[name][1])
                      if f.name not in ("seed", "size")]
            unknown = sorted(set(config) - set(fields))
            fix = (f"; {name}'s config fields: {fields}" if unknown else "; see the task's config class for the "
                   "values it takes")
            raise ConfigError(f"{FIELD}.tasks.{name}.config: reasoning-gym refuses {config}: "
                              f"{type(e).__name__}: {e}{fix}") from None
        out[name] = {"weight": float(weight), "config": config}
    return {"tasks": out, "size": size, "test_size": test_size, "seed": seed}


@functools.lru_cache(maxsize=16)
def _dataset(spec_json: str):
    """The reasoning-gym dataset of a normalised spec (as JSON): all ``test_size + size`` rows."""
    rg = _rg("reward.fn", RewardError)
    spec = json.loads(spec_json)
    size, seed, tasks = spec["test_size"] + spec["size"], spec["seed"], spec["tasks"]
    if len(tasks) == 1:
        (name, task), = tasks.items()
        return rg.create_dataset(name, **{"seed": seed, "size": size, **task["config"]})
    from reasoning_gym.composite import DatasetSpec

    return rg.create_dataset("composite", size=size, seed=seed,
                             datasets=[DatasetSpec(name, t["weight"], t["config"]) for name, t in tasks.items()])


def dataset(spec: Mapping[str, Any]):
    """The reasoning-gym dataset of ``spec`` (:func:`normalise_kwargs`), cached."""
    return _dataset(json.dumps(spec, sort_keys=True))


def reasoning_gym_rows(kwargs: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The train and test rows (module docstring) of ``data.prepare_kwargs``."""
    spec = normalise_kwargs(kwargs)
    ds = dataset(spec)
    rows = []
    for i in range(spec["test_size"] + spec["size"]):
        entry = ds[i]
        rows.append({"question": entry["question"], "ground_truth": json.dumps({"spec": spec, "index": i}),
                     "task": entry["metadata"].get("source_dataset", next(iter(spec["tasks"]))),
                     "answer": str(entry["answer"])})
    return {"test": rows[:spec["test_size"]], "train": rows[spec["test_size"]:]}


def prepare_reasoning_gym(out_dir: str | os.PathLike, kwargs: Mapping[str, Any], *,
                          overwrite: bool = False) -> dict[str, Path]:
    """Write the train and test splits of ``kwargs`` (``data.prepare_kwargs``) as parquet into ``out_dir``
    (:func:`megarl.data.dataset.write_splits`: the folder's rule, ``megarl_data_reasoning_gym.json``).

    Raises:
        ConfigError: ``kwargs`` (:func:`normalise_kwargs`). OutputFolderError: as ``write_splits``.
    """
    import pyarrow as pa

    def tables():
        out = {}
        for split, rows in reasoning_gym_rows(kwargs).items():
            columns = {"index": pa.array(range(len(rows)), pa.int64())}
            columns.update({k: [r[k] for r in rows] for k in ("question", "ground_truth", "task", "answer")})
            out[split] = pa.table(columns)
        return out
    normalise_kwargs(kwargs)  # refused before the folder is claimed
    return write_splits(SPLITS, tables, out_dir, "data reasoning_gym", overwrite=overwrite)


def check_prepared(files: Sequence[str], kwargs: Mapping[str, Any]) -> None:
    """The reasoning-gym files among ``files`` that exist were generated from ``kwargs`` (their first row's
    spec), so a run never trains on another task than its config names.

    Raises:
        ConfigError: naming ``data.prepare_kwargs``, the file, both settings and the fix.
    """
    spec = normalise_kwargs(kwargs)
    for f in files:
        if not Path(f).is_file():
            continue
        rows = read_rows(f)
        try:
            held = json.loads(rows[0]["ground_truth"])["spec"]
        except (IndexError, KeyError, TypeError, ValueError):
            raise ConfigError(f"{FIELD}: {f} holds no reasoning-gym rows (no ground_truth spec); point the "
                              "data files at a folder that data.prepare=reasoning_gym writes") from None
        if held != spec:
            raise ConfigError(f"{FIELD}: {f} was generated from {held}, not from {spec}; delete its folder "
                              "(data.prepare writes it again) or point the data files at another folder")


def reasoning_gym_reward(prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str | None], *,
                         answer_tag: str = "") -> list[float]:
    """Score ``B`` responses with their task's own ``score_answer`` (module docstring).

    Args:
        prompts: unused.
        responses: ``B`` response texts.
        ground_truths: ``B`` JSON ground truths written by :func:`prepare_reasoning_gym`.
        answer_tag: score the content of the last ``<tag>...</tag>`` (reasoning-gym's ``extract_answer``; none
            found: the answer is None) instead of the whole response stripped; "" = the whole response.

    Returns:
        ``B`` floats in ``[0, 1]``.

    Raises:
        RewardError: reasoning-gym missing, or a ground truth that is not one of these rows'.
    """
    _rg("reward.fn", RewardError)
    from reasoning_gym.utils import extract_answer

    scores = []
    for i, (response, truth) in enumerate(zip(responses, ground_truths)):
        try:
            row = json.loads(truth)
            ds, index = dataset(row["spec"]), int(row["index"])
        except (TypeError, ValueError, KeyError) as e:
            raise RewardError(f"sample {i}: ground truth {str(truth)[:80]!r} is not a reasoning-gym row's "
                              f"({type(e).__name__}: {e}); reward.fn=reasoning_gym scores the data that "
                              "data.prepare=reasoning_gym writes") from None
        answer = extract_answer(response, tag_name=answer_tag) if answer_tag else response.strip()
        scores.append(float(ds.score_answer(answer, ds[index])))
    return scores
