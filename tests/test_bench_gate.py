"""The speed gate (``megarl bench gate``, :mod:`megarl.bench.gate`) on the CPU: a report with the stored history's
figures passes, a deliberately slowed one fails with one line per regressed figure, a report of another GPU or case
is not compared (and says so), a passing run can be appended, and the stored history itself is well formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.bench.gate import FIGURES, case_key, figures_of, gate, parse_tolerances, read_history

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / "perf" / "history" / "bench_step.jsonl"
GRPO = "grpo-1.5b-fast rollout.model_runner=v2 algorithm.rollout_correction.preset=token_tis"
MOE = "gpu_moe.sh bench_step"


def stored(case: str) -> dict:
    return next(r for r in read_history(HISTORY) if r["case"] == case_key(case))


def report_from(figures: dict[str, float], *, device: str = "NVIDIA H200", world: int = 1, scale_time: float = 1.0,
                scale_mfu: float = 1.0, status: str = "ok") -> dict:
    """A ``bench step`` report holding ``figures`` (times times ``scale_time``, MFUs times ``scale_mfu``)."""
    r = {"status": status, "device": device, "world_size": world, "phases": {}, "machine": {"commit": "abc"}}
    for name, value in figures.items():
        phase, _, key = name.rpartition(".")
        value *= scale_time if key.endswith("time_s") else scale_mfu
        (r["phases"].setdefault(phase, {}) if phase else r)[key] = value
    return r


def run_gate(tmp_path, report: dict, case: str, capsys, **kw) -> tuple[int, list[str]]:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    rc = gate(path, case, history_path=kw.pop("history", HISTORY), **kw)
    return rc, capsys.readouterr().out.splitlines()


def test_the_stored_history_holds_measured_runs_with_their_source():
    records = read_history(HISTORY)
    assert len(records) >= 3
    for r in records:
        assert r["gpu"].startswith("NVIDIA ") and r["gpus"] >= 1 and r["date"] and "perf/RESULTS.md" in r["source"]
        assert set(r["figures"]) <= set(FIGURES) and "step_time_s" in r["figures"]
    assert stored(GRPO)["figures"]["step_time_s"] == 9.31  # RESULTS.md's bench step of grpo-1.5b-fast, H200
    assert stored(MOE)["figures"]["actor_update.mfu"] == 0.242


def test_a_run_with_the_stored_figures_passes(tmp_path, capsys):
    rc, lines = run_gate(tmp_path, report_from(stored(GRPO)["figures"]), GRPO, capsys)
    assert rc == 0 and lines[-1].endswith(": PASS")
    assert sum(line.startswith("ok ") for line in lines) == len(stored(GRPO)["figures"])
    rc, lines = run_gate(tmp_path, report_from(stored(GRPO)["figures"], scale_time=1.14), GRPO, capsys)
    assert rc == 0, lines  # 14% slower: within the default 15%


def test_a_slowed_run_fails_with_one_line_per_regressed_figure(tmp_path, capsys):
    figures = stored(GRPO)["figures"]
    rc, lines = run_gate(tmp_path, report_from(figures, scale_time=1.2), GRPO, capsys)
    regressed = [line for line in lines if line.startswith("REGRESSED")]
    assert rc == 1 and lines[-1].endswith(": FAIL") and len(regressed) == len(figures)
    assert ("REGRESSED step_time_s 11.172 s against 9.310 s (median of the last 1 run(s) of "
            f"'{case_key(GRPO)}' on 1 x NVIDIA H200): +20.0%, beyond the tolerance of 15%") in regressed
    # MFU: lower is worse; times alone within tolerance
    rc, lines = run_gate(tmp_path, report_from(stored(MOE)["figures"], scale_mfu=0.8), MOE, capsys)
    regressed = [line.split()[1] for line in lines if line.startswith("REGRESSED")]
    assert rc == 1 and regressed == ["mfu", "old_logprobs.mfu", "actor_update.mfu"]
    # a tighter tolerance for one figure
    rc, lines = run_gate(tmp_path, report_from(figures, scale_time=1.1), GRPO, capsys,
                         tolerances=parse_tolerances(["step_time_s=0.05"]))
    assert rc == 1 and [line.split()[1] for line in lines if line.startswith("REGRESSED")] == ["step_time_s"]


def test_a_faster_run_passes_and_says_so(tmp_path, capsys):
    rc, lines = run_gate(tmp_path, report_from(stored(GRPO)["figures"], scale_time=0.5), GRPO, capsys)
    assert rc == 0 and all(line.startswith("better") for line in lines[:-1]) and "append this run" in lines[0]


def test_another_gpu_or_case_is_not_compared_and_says_so(tmp_path, capsys):
    slow = report_from(stored(GRPO)["figures"], scale_time=3.0, device="NVIDIA H100 80GB HBM3")
    rc, lines = run_gate(tmp_path, slow, GRPO, capsys)
    assert rc == 0 and lines[-1].endswith(": NOT COMPARED")
    assert lines[0].startswith(f"bench gate: not compared: the history has no run of '{case_key(GRPO)}' on 1 x "
                               "NVIDIA H100 80GB HBM3 (it holds ") and "on 1 x NVIDIA H200" in lines[0]
    for case, world in (("grpo-1.5b-fast", 1), (GRPO, 2)):  # without the overrides; on two GPUs
        slowed = report_from(stored(GRPO)["figures"], scale_time=3.0, world=world)
        rc, lines = run_gate(tmp_path, slowed, case, capsys)
        assert rc == 0 and "not compared" in lines[0]
    reordered = "grpo-1.5b-fast " + " ".join(reversed(GRPO.split()[1:]))
    rc, lines = run_gate(tmp_path, report_from(stored(GRPO)["figures"], scale_time=3.0), reordered, capsys)
    assert rc == 1  # the overrides in another order: the same case


def test_append_adds_a_passing_run_and_never_a_regressed_one(tmp_path, capsys):
    history = tmp_path / "history.jsonl"
    history.write_text(HISTORY.read_text())
    before = len(read_history(history))
    report = report_from({"step_time_s": 2.0, "mfu": 0.4}, device="NVIDIA H100 80GB HBM3")
    rc, lines = run_gate(tmp_path, report, "new-case", capsys, history=history, append=True, source="a test")
    assert rc == 0 and "appended" in lines[-1]
    new = read_history(history)[-1]
    assert len(read_history(history)) == before + 1
    assert new["case"] == "new-case" and new["gpu"] == "NVIDIA H100 80GB HBM3" and new["gpus"] == 1
    assert new["figures"] == {"step_time_s": 2.0, "mfu": 0.4} and new["source"] == "a test" and new["commit"] == "abc"
    slow = report_from({"step_time_s": 3.0, "mfu": 0.4}, device="NVIDIA H100 80GB HBM3")
    rc, lines = run_gate(tmp_path, slow, "new-case", capsys, history=history, append=True)
    assert rc == 1 and len(read_history(history)) == before + 1


def test_a_failed_run_and_bad_input(tmp_path, capsys):
    failed = report_from({"step_time_s": 1.0}, status="oom") | {"error": "OutOfMemoryError: x"}
    rc, lines = run_gate(tmp_path, failed, GRPO, capsys)
    assert rc == 1 and "FAIL: the run's status is 'oom'" in lines[-1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(HISTORY.read_text() + '{"case": "x"}\n')
    line = len(HISTORY.read_text().splitlines()) + 1
    with pytest.raises(ValueError, match=rf"bad.jsonl:{line}: a record needs case, gpu, gpus, figures, source"):
        read_history(bad)
    with pytest.raises(ValueError, match=r"--tolerance 'step=0.1': no figure 'step'"):
        parse_tolerances(["step=0.1"])
    with pytest.raises(ValueError, match=r"--tolerance '15': the fraction must lie in \(0, 1\)"):
        parse_tolerances(["15"])
    with pytest.raises(FileNotFoundError, match="no report"):
        gate(tmp_path / "none.json", GRPO)
    assert figures_of({"step_time_s": None, "phases": {"generate": {"time_s": 1.5, "mfu": None}}}) == {
        "generate.time_s": 1.5}


def test_the_command_line(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report_from(stored(GRPO)["figures"], scale_time=1.3)))
    cmd = [sys.executable, "-m", "megarl.cli", "bench", "gate", str(path), "--case", GRPO]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1 and r.stdout.count("\nREGRESSED") + r.stdout.startswith("REGRESSED") == 5, r.stdout
    r = subprocess.run(cmd + ["--tolerance", "0.35"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip().endswith(": PASS"), r.stdout + r.stderr
    r = subprocess.run(cmd + ["--tolerance", "x=1"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("megarl: error: bench gate: --tolerance 'x=1'"), r.stderr
