"""The GPU scripts of ``perf/`` on the CPU: every ``megarl`` command line of every ``perf/gpu_*.sh`` runs
through the checks a run makes before it starts (``--check``: the config against its model, tokenizer, files
and reward function), so that a config change that breaks a GPU script fails here rather than on the GPU
machine (issue 24: ``perf/gpu_offload.sh`` validated on files its synthetic task never prepares).

Each script runs for real from a view of the checkout without its ignored files (no ``data/``, no ``runs/``:
what a fresh clone on the GPU machine has), with ``python3`` and ``bash`` replaced by shell functions: a
``python3 -m megarl.cli ...`` gets ``--check`` (``megarl data`` prepares data, not a config: skipped), inline
Python that builds the synthetic task of :mod:`tests.rl_tasks` runs, and the rest (pytest, the post-processing
of a run's metrics, kernel benchmarks) is skipped, as are ``perf/install_wheels.sh`` and ``perf/build_C.sh``.
The Python that runs is served by one :mod:`tests.python_server` for the module (no interpreter start and no
imports per call).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the scripts that run megarl: themselves, or through perf/gpu_lib.sh's train_fresh / train_resumable (gpu_lib.sh
# is sourced)
SCRIPTS = sorted(p.name for p in (REPO / "perf").glob("gpu_*.sh") if p.name != "gpu_lib.sh"
                 and ("megarl.cli" in (text := p.read_text()) or "train_resumable " in text or "train_fresh " in text))
# the scripts that take a case as their first argument, with the cases that run megarl
CASES = {"gpu_bench_step.sh": ["mfu-1.5b", "mem-0.5b", "grpo-1.5b", "grpo-1.5b-fast", "qwen3-8b", "smollm2"],
         "gpu_async.sh": ["colocated", "split-sync", "split-async"]}
BY_NAME = [("gpu_lora.sh", "7b-full")]  # cases a script runs by name only, besides its default list

_STUBS = r'''
_served() {  # python3 "$@" in the module's tests.python_server: its output, then its exit status
  local req; req=$(mktemp -d "$MEGARL_CHECK_SERVER/call.XXXXXX")
  printf '%s\0' "$@" > "$req/argv"; env -0 > "$req/env"; pwd > "$req/cwd"
  [ "${1:-}" = "-" ] && cat > "$req/stdin"
  echo "$req" > "$MEGARL_CHECK_SERVER/fifo"
  local waited=0
  while [ ! -f "$req/rc" ]; do
    sleep 0.05; waited=$(( waited + 1 ))
    [ $waited -gt 12000 ] && { echo "tests.python_server: no answer in 600 s"; return 1; }
  done
  cat "$req/out"
  return "$(cat "$req/rc")"
}
python3() {
  if [ "${1:-}" = "-m" ] && [ "${2:-}" = "megarl.cli" ]; then
    shift 2
    [ "${1:-}" = "data" ] && return 0
    local rc=0
    _served -m megarl.cli "$@" --check || rc=$?
    echo "$rc megarl $*" >> "$MEGARL_CHECK_LOG"
    return $rc
  elif [ "${1:-}" = "-c" ]; then
    case "$2" in *tests.rl_tasks*) _served "$@" ;; *) return 0 ;; esac
  elif [ "${1:-}" = "-" ]; then
    local code; code=$(cat)
    case "$code" in *tests.rl_tasks*) _served "$@" <<< "$code" ;; *) return 0 ;; esac
  else
    return 0
  fi
}
bash() {
  case "${1:-}" in perf/install_wheels.sh|perf/build_C.sh) return 0 ;; esac
  command bash "$@"
}
export -f _served python3 bash
'''


@pytest.fixture(scope="module")
def python_server(tmp_path_factory):
    """A :mod:`tests.python_server` for the module: its folder (with the FIFO ``fifo``) for ``_served``."""
    folder = tmp_path_factory.mktemp("python_server")
    os.mkfifo(folder / "fifo")
    server = subprocess.Popen([sys.executable, "-m", "tests.python_server", str(folder / "fifo")], cwd=REPO)
    yield folder
    server.kill()
    server.wait()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, python_server):
    """The checkout's tracked top-level entries, linked into a fresh folder (no data/, runs/, .venv), and the
    module's Python server."""
    root = tmp_path_factory.mktemp("checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in sorted({line.split("/")[0] for line in tracked.splitlines()}):
        (root / name).symlink_to(REPO / name)
    (root / "megarl").unlink()
    (root / "megarl").symlink_to(REPO / "megarl")  # with its built extension
    gsm8k = tmp_path_factory.mktemp("gsm8k")
    (gsm8k / "train.jsonl").write_text("")
    return root, gsm8k, python_server


def _run_script(checkout, name: str, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    root, gsm8k, server = checkout
    out = root / "out" / f"{name}{'-' + args[0] if args else ''}"
    out.mkdir(parents=True)
    log = out / "megarl_commands.txt"
    from megarl.models.hf_io import default_model_path

    env = {**os.environ, "OUT": str(out), "MEGARL_CHECK_LOG": str(log), "MEGARL_CHECK_SERVER": str(server),
           "SMOL_GGUF": str(default_model_path()),
           "GSM8K_DIR": str(gsm8k),
           "OPD_TEACHER": str(default_model_path())}  # gpu_workflow.sh's teacher (its teacher run is checked only)
    command = f"{_STUBS}\ncommand bash perf/{name} " + " ".join(args)
    r = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    return r, (log.read_text().splitlines() if log.exists() else [])


@pytest.mark.parametrize("script,args", [(s, ()) for s in SCRIPTS if s not in CASES]
                         + [(s, (case,)) for s, cases in CASES.items() for case in cases]
                         + [(s, (case,)) for s, case in BY_NAME])
def test_every_megarl_command_of_a_gpu_script_passes_its_checks(checkout, script, args):
    r, commands = _run_script(checkout, script, *args)
    text = r.stdout + r.stderr
    assert commands, f"perf/{script} ran no megarl command:\n{text[-3000:]}"
    failed = [c for c in commands if not c.startswith("0 ")]  # exit status, then the command
    assert not failed and r.returncode == 0, f"{failed}\n{text[-5000:]}"
    if script == "gpu_bench_step.sh":  # the speed gate after the run, on the stored history
        assert any(c.startswith("0 megarl bench gate ") for c in commands), commands


def test_gpu_scripts_import_torch_before_megarl_C():
    """``megarl._C`` links against torch's libraries: importing it first fails (``libc10.so`` not found), as
    ``perf/gpu_multi.sh``'s build check did."""
    bad = []
    for path in sorted((REPO / "perf").glob("*.sh")):
        for code in re.findall(r'python3? -c "([^"]*)"', path.read_text()):
            imports = re.findall(r"import ([\w., ]+)", code)
            names = [n.strip() for group in imports for n in group.split(",")]
            if "megarl._C" in names and ("torch" not in names or names.index("torch") > names.index("megarl._C")):
                bad.append(f"{path.name}: {code}")
    assert not bad, bad
