"""``megarl bench gate REPORT.json --case NAME``: a speed gate for ``megarl bench step``.

A ``bench step`` report (:mod:`megarl.bench.step`, its ``--json``) is compared with the stored history of the
same case on the same machine: a JSON-lines file (default ``perf/history/bench_step.jsonl``), one record per
measured run::

    {"case": "grpo-1.5b-fast", "gpu": "NVIDIA H200", "gpus": 1, "figures": {"step_time_s": 9.31, ...},
     "date": "2026-12-03", "commit": "f0ef281", "source": "perf/RESULTS.md, ...", "machine": {...}}

- **The case** is a name the caller gives (``perf/gpu_bench_step.sh`` passes its CASE and any extra
  overrides: ``grpo-1.5b-fast rollout.model_runner=v2``); the overrides after the name are compared as a set.
  **The machine** is the report's ``device`` (``torch.cuda.get_device_name()``, e.g. "NVIDIA H200" or "NVIDIA
  H100 80GB HBM3") and ``world_size``. A report whose case or machine has no record is not compared: the gate
  says so and passes (exit 0), naming the cases and machines the history holds.
- **The figures** (:data:`FIGURES`): the step's seconds and MFU, and the seconds and MFU of the model phases;
  each is compared with the median of the last ``window`` records (default 3) of the case and machine that
  hold it, and those missing from either side are left out. A figure whose time grew, or whose MFU fell, by more
  than its tolerance (default 15% for each, as prime-rl's benchmark regression test keeps a margin on step time
  and MFU; ``--tolerance 0.1`` for all, ``--tolerance step_time_s=0.05`` for one) has **regressed**: one line
  each, and the gate fails (exit 1). A report whose status is not "ok" fails too. Figures better than their
  tolerance are noted (the history's run may be outdated: append this one).
- ``--append`` adds the report as a record after a pass (a regressed run is no baseline), with ``--source``
  saying where it came from; the figures are those of the report, never edited.

Units: seconds; MFU as a fraction (0-1) of the datasheet dense bf16 peak, as in the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from megarl.jsonl import append_records

DEFAULT_HISTORY = Path("perf/history/bench_step.jsonl")
DEFAULT_TOLERANCE = 0.15
DEFAULT_WINDOW = 3
LOWER, HIGHER = "lower", "higher"  # which way is better
# figure name -> (which way is better, unit); phase figures are "<phase>.time_s" and "<phase>.mfu"
FIGURES: dict[str, tuple[str, str]] = {
    "step_time_s": (LOWER, "s"), "mfu": (HIGHER, ""),
    **{f"{p}.time_s": (LOWER, "s") for p in ("generate", "old_logprobs", "reference", "actor_update")},
    **{f"{p}.mfu": (HIGHER, "") for p in ("old_logprobs", "reference", "actor_update")},
}
RECORD_KEYS = ("case", "gpu", "gpus", "figures", "source")


def case_key(case: str) -> str:
    """``NAME [key=value ...]`` with the overrides sorted: the same case whatever their order.

    Raises:
        ValueError: an empty case.
    """
    words = case.split()
    if not words:
        raise ValueError("bench gate: --case is empty; give the case's name (and its extra overrides)")
    return " ".join([words[0], *sorted(words[1:])])


def figures_of(report: dict[str, Any]) -> dict[str, float]:
    """The :data:`FIGURES` a ``bench step`` report holds (null or absent ones left out)."""
    out = {}
    for name in FIGURES:
        phase, _, key = name.rpartition(".")
        value = (report.get("phases") or {}).get(phase, {}).get(key) if phase else report.get(name)
        if isinstance(value, (int, float)) and value == value:
            out[name] = float(value)
    return out


def record_of(report: dict[str, Any], case: str, source: str, *, date: str | None = None) -> dict[str, Any]:
    """The history record of a report: its case, machine, figures, date and source."""
    machine = report.get("machine") or {}
    return {"case": case_key(case), "gpu": report["device"], "gpus": int(report["world_size"]),
            "figures": figures_of(report), "date": date or datetime.date.today().isoformat(),
            "commit": machine.get("commit"), "source": source, "machine": machine}


def read_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a history file, in order (a missing file: none).

    Raises:
        ValueError: a line that is not a JSON record with :data:`RECORD_KEYS`, naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"bench gate: {path}:{n}: not JSON ({e}); fix or remove that line") from None
        missing = [k for k in RECORD_KEYS if k not in r] if isinstance(r, dict) else list(RECORD_KEYS)
        if missing or not isinstance(r["figures"], dict):
            raise ValueError(f"bench gate: {path}:{n}: a record needs {', '.join(RECORD_KEYS)} (figures an object); "
                             f"missing {missing or ['figures as an object']}")
        records.append(r)
    return records


def parse_tolerances(specs: Sequence[str]) -> dict[str, float]:
    """Each figure's tolerance from ``--tolerance`` values: ``F`` (every figure) or ``NAME=F`` (one), F in (0, 1).

    Raises:
        ValueError: an unknown figure or a fraction outside (0, 1).
    """
    out = dict.fromkeys(FIGURES, DEFAULT_TOLERANCE)
    for spec in specs:
        name, _, text = spec.rpartition("=")
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < 1:
            raise ValueError(f"bench gate: --tolerance {spec!r}: the fraction must lie in (0, 1), e.g. 0.15")
        if name and name not in FIGURES:
            raise ValueError(f"bench gate: --tolerance {spec!r}: no figure {name!r}; one of {', '.join(FIGURES)}")
        out.update({name: value} if name else dict.fromkeys(FIGURES, value))
    return out


@dataclass
class Verdict:
    """The gate's answer: ``status`` "pass", "fail" or "not compared", and its lines (one per figure)."""

    status: str
    lines: list[str] = field(default_factory=list)


def _fmt(value: float, unit: str) -> str:
    return f"{value:.3f} s" if unit == "s" else f"{value:.1%}"


def judge(record: dict[str, Any], history: list[dict[str, Any]], tolerances: dict[str, float], *,
          window: int = DEFAULT_WINDOW) -> Verdict:
    """Compare a run's record (:func:`record_of`) with the history's records of its case and machine.

    Returns:
        A :class:`Verdict`: "not compared" with one line where the history has no record of the case and
        machine; else "fail" where a figure regressed beyond its tolerance, "pass" otherwise, with a line per
        compared figure (``REGRESSED``, ``ok`` or ``better``).
    """
    key, gpu, gpus = record["case"], record["gpu"], record["gpus"]
    machine = f"{gpus} x {gpu}"
    same = [r for r in history if case_key(r["case"]) == key and r["gpu"] == gpu and int(r["gpus"]) == gpus]
    if not same:
        held = sorted({f"'{r['case']}' on {r['gpus']} x {r['gpu']}" for r in history}) or ["nothing"]
        return Verdict("not compared", [f"bench gate: not compared: the history has no run of '{key}' on "
                                        f"{machine} (it holds {'; '.join(held)})"])
    lines, failed = [], False
    for name, value in record["figures"].items():
        past = [float(r["figures"][name]) for r in same if name in r["figures"]][-window:]
        if not past:
            continue
        base = statistics.median(past)
        better, unit = FIGURES[name]
        change = value / base - 1 if base else 0.0
        worse = change if better == LOWER else -change
        tol = tolerances[name]
        what = (f"{name} {_fmt(value, unit)} against {_fmt(base, unit)} (median of the last {len(past)} run(s) "
                f"of '{key}' on {machine}): {change:+.1%}")
        if worse > tol:
            failed = True
            lines.append(f"REGRESSED {what}, beyond the tolerance of {tol:.0%}")
        elif worse < -tol:
            lines.append(f"better    {what}, beyond the tolerance of {tol:.0%}: append this run to the history")
        else:
            lines.append(f"ok        {what}")
    if not lines:
        return Verdict("not compared", [f"bench gate: not compared: the history's runs of '{key}' on {machine} "
                                        "share no figure with this report"])
    return Verdict("fail" if failed else "pass", lines)


def gate(report_path: str | os.PathLike, case: str, *, history_path: str | os.PathLike = DEFAULT_HISTORY,
         tolerances: dict[str, float] | None = None, window: int = DEFAULT_WINDOW, append: bool = False,
         source: str | None = None) -> int:
    """Read the report and the history, print the verdict, append the run after a pass when asked.

    Returns:
        0 (passed, or not compared), 1 (a figure regressed, or the report's status is not "ok").

    Raises:
        FileNotFoundError: no report at ``report_path``.
        ValueError: a report that is not a ``bench step`` JSON, a damaged history line, an empty case.
    """
    path = Path(report_path)
    if not path.is_file():
        raise FileNotFoundError(f"bench gate: no report {path}; run `megarl bench step ... --json {path}` first")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"bench gate: {path} is not JSON ({e}); give the --json file of `megarl bench step`") from None
    if not isinstance(report, dict) or "status" not in report or "device" not in report:
        raise ValueError(f"bench gate: {path} is not a `megarl bench step` report (no status or device)")
    name = case_key(case)
    if report["status"] != "ok":
        print(f"bench gate '{name}': FAIL: the run's status is {report['status']!r}: {report.get('error')}")
        return 1
    record = record_of(report, name, source or f"megarl bench gate --append {path}")
    verdict = judge(record, read_history(history_path), tolerances or parse_tolerances([]), window=window)
    for line in verdict.lines:
        print(line)
    print(f"bench gate '{name}' on {record['gpus']} x {record['gpu']}: {verdict.status.upper()}")
    if verdict.status == "fail":
        return 1
    if append:
        append_records(history_path, [record])
        print(f"bench gate: appended the run to {history_path}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``megarl bench gate`` (:func:`run` runs it)."""
    p.description = "Speed gate (megarl/bench/gate.py): exit 1 when a figure regressed beyond its tolerance."
    p.add_argument("report", help="the --json file of `megarl bench step`")
    p.add_argument("--case", required=True, help="the case's name and extra overrides, e.g. 'grpo-1.5b-fast "
                   "rollout.model_runner=v2' (perf/gpu_bench_step.sh passes its own)")
    p.add_argument("--history", default=str(DEFAULT_HISTORY), help=f"JSON-lines history (default {DEFAULT_HISTORY})")
    p.add_argument("--tolerance", action="append", default=[], metavar="[FIGURE=]FRACTION",
                   help="allowed regression, 0.15 (the default) for every figure or step_time_s=0.1 for one; "
                        "repeatable")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"compare with the median of the case's last N runs (default {DEFAULT_WINDOW})")
    p.add_argument("--append", action="store_true", help="after a pass, add this run to the history")
    p.add_argument("--source", default=None, help="where the appended run comes from (default: the report path)")
    p.add_argument("--check", action="store_true", help="check the history and the flags; no report needed")


def run(a: argparse.Namespace) -> int:
    """``megarl bench gate``: :func:`gate` with the arguments of :func:`add_arguments`; with ``--check``, only
    the history, the case and the tolerances are checked.

    Raises:
        ValueError: a bad ``--tolerance``, ``--window`` or ``--case``, a damaged history (and :func:`gate`'s).
    """
    tolerances = parse_tolerances(a.tolerance)
    if a.window < 1:
        raise ValueError(f"bench gate: --window must be >= 1, got {a.window}")
    if a.check:
        case_key(a.case)
        print(f"megarl bench gate: check passed ({len(read_history(a.history))} run(s) in {a.history})")
        return 0
    return gate(a.report, a.case, history_path=a.history, tolerances=tolerances, window=a.window, append=a.append,
                source=a.source)
