"""The ``megarl`` command itself: what ``--help`` costs, the defaults of ``bench reshard``, and the status of a
crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_HELP_OF_EVERY_COMMAND = """
import sys
from megarl.cli import _COMMANDS, main
for path in [()] + [p for p, _, _ in _COMMANDS]:
    try:
        main([*path, "--help"])
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "megatron", "transformers", "vllm") if m in sys.modules))
"""


def test_help_imports_neither_torch_nor_megatron():
    """Issue 24: each ``--help`` took 2.5-7.5 s, importing torch and megatron-core for every command's
    arguments; ``megarl --help`` and every ``megarl COMMAND --help`` now import none of them."""
    r = subprocess.run([sys.executable, "-c", _HELP_OF_EVERY_COMMAND], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]
    assert "micro" in r.stdout and "(default 3)" in r.stdout  # bench reshard's help: its modes and defaults


def test_bench_reshard_micro_runs_with_its_defaults_and_says_what_it_measured():
    """Issue 24: ``bench reshard micro`` failed with its defaults (its TP=2 case on SmolLM2's 9 heads), and
    its table did not say which case it measured."""
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "reshard", "micro", "--layers", "1",
                        "--iters", "1"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    head = r.stdout.splitlines()[0]
    assert head.startswith("bench reshard micro: smollm2-135m cut to 1 layers, bf16, on cpu") and \
        "Megatron TP=1 -> vLLM TP=3" in head, r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines()[-3:]] == ["local_copy", "pack", "unpack"]
    assert all(line.split()[-1] in ("True", "-") for line in r.stdout.splitlines()[-3:]), r.stdout


def test_bench_reshard_layout_runs_its_spawned_world(tmp_path):
    """Issue 33 item 7: ``bench reshard`` (layout mode, local processes) crashed at once, pickling the command's
    own function with its arguments for the ranks (``Can't pickle local object '_bench_reshard.<locals>.run'``)."""
    out = tmp_path / "reshard.json"
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "reshard", "--model", "tiny-llama", "--layers",
                        "2", "--nproc", "2", "--src-tp", "2", "--iters", "1", "--warmup", "0", "--json", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = __import__("json").loads(out.read_text())["ranks"]
    assert [sorted(m) for m in (rank["methods"] for rank in ranks)] == \
        [["gather_full", "per_tensor_allgather", "reshard"]] * 2
    assert all(m["exact"] for rank in ranks for m in rank["methods"].values()), ranks


_CRASH = """
import sys
import megarl.cli as cli

@cli.command("crash", help="a command with a bug")
def _crash(p):
    def run(a):
        raise AttributeError("a bug")
    return run

sys.argv = ["megarl", "crash"]
cli.entry()
"""


def test_a_crash_prints_its_traceback_and_never_exits_0():
    """Issue 33 item 7: a crash must not end with status 0; it ends through :func:`megarl.cli.end_process` (the
    processes it started end with it) with status 1 and its traceback."""
    r = subprocess.run([sys.executable, "-c", _CRASH], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert r.stderr.strip().splitlines()[-1] == "AttributeError: a bug", r.stderr[-3000:]


def rank_holding_a_semaphore() -> None:
    """A spawned rank's end, as ``run_world``'s: a semaphore registered with its launcher's resource tracker
    (tqdm's lock, made by a GGUF dequantisation), then :func:`~megarl.parallel.lifecycle.end_descendants`, then
    the process's exit, which releases the semaphore."""
    import multiprocessing as mp

    from megarl.parallel.lifecycle import end_descendants

    global _SEMAPHORE
    _SEMAPHORE = mp.get_context("spawn").Lock()
    end_descendants()


_SPAWN_A_RANK = """
import multiprocessing as mp
from tests.test_cli import rank_holding_a_semaphore
p = mp.get_context("spawn").Process(target=rank_holding_a_semaphore)
p.start()
p.join()
assert p.exitcode == 0, p.exitcode
"""


def test_a_spawned_rank_ends_without_a_resource_tracker_traceback():
    """Issue 48: ``megarl convert`` of a GGUF file ended in a ``multiprocessing.resource_tracker`` ``KeyError``
    traceback and a leaked-semaphore warning: the rank's ``end_descendants`` closed its end of its launcher's
    tracker, so its exit released tqdm's semaphore through a second tracker that had never seen it."""
    r = subprocess.run([sys.executable, "-c", _SPAWN_A_RANK], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and "resource_tracker" not in r.stderr and "Traceback" not in r.stderr, r.stderr


_LOG_AS_RANK = """
import logging
from megarl.console import quiet_libraries, quiet_other_ranks
quiet_libraries()
quiet_other_ranks()
logging.getLogger("megarl.trainer").warning("a note")
logging.getLogger("megarl.trainer").error("an error")
"""


def test_a_note_comes_from_rank_0_alone_and_errors_from_every_rank():
    """Issue 24: multi-rank runs printed a warning once per rank."""
    def run(rank: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")} | {"RANK": rank}
        return subprocess.run([sys.executable, "-c", _LOG_AS_RANK], capture_output=True, text=True, cwd=REPO,
                              env=env, timeout=300).stderr

    zero, one = run("0"), run("1")
    assert "a note" in zero and "an error" in zero, zero
    assert "a note" not in one and "an error" in one, one


def test_overrides_after_resume_are_read(tmp_path, capsys, monkeypatch):
    """Issue 48: ``megarl train CONFIG --resume trainer.steps=N`` (the README's and the error hint's order) failed
    with "unrecognized arguments"; overrides before and after the flag are read, in order (here the run folder
    of ``run.output_dir``/``run.name`` given after it, which holds no checkpoint); an unknown flag is still
    refused."""
    from megarl.cli import main

    argv = ["train", "parallel_configs/cpu_smollm2_grpo.yaml", "run.name=first", "--resume",
            f"run.output_dir={tmp_path}", "run.name=later"]
    monkeypatch.chdir(REPO)
    assert main(argv) == 2
    err = capsys.readouterr().err
    want = f"megarl: error: trainer.resume: the run folder {tmp_path / 'later'} holds no checkpoint"
    assert err.startswith(want), err
    assert main(["train", "parallel_configs/cpu_smollm2_grpo.yaml", "--resume", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
