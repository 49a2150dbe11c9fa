#!/usr/bin/env bash
# Environments from libraries on one H100/H200 (issue 44), from the repo root:   bash perf/gpu_environments.sh
#
# Needs the vLLM wheels in /tmp/whl (as perf/gpu_vllm.sh; carry .whl), the wheels of the environment libraries
# in /tmp/envwhl (verifiers 0.4.0, textarena 0.7.4 and their dependencies that the machine lacks: one upload of
# a folder made here with `pip download verifiers==0.4.0 textarena==0.7.4 websockets==17.4` for Python 3.12,
# less the packages torch and transformers bring, with kernels==0.16.2), and the SmolLM2-135M GGUF (SMOL_GGUF,
# default /tmp/smol.gguf, or its two halves, perf/gpu_smollm2_gsm8k.sh). Stages:
#   1. install: the vLLM wheels into /tmp/site (skipped when done), then verifiers and textarena with pip from
#      /tmp/envwhl only (what the machine has already satisfies the rest);
#   2. verifiers: parallel_configs/gpu_1xh200_smollm2_verifiers.yaml, STEPS (default 100) GRPO steps on the
#      tests' verifiers taskset vf_guess (guess a number from 1 to 30 over up to 6 turns, verifiers' rubric);
#   3. textarena: parallel_configs/gpu_1xh200_smollm2_textarena.yaml, STEPS steps of TicTacToe-v0 against a
#      random opponent;
#   4. summary: $OUT/environments_summary.md, a table by 10 steps for each run (reward, each reward function /
#      game outcome rate, turns, sampled tokens per episode, step and generate seconds) and the validation before
#      and after (verifiers), and $OUT/environments.png (reward, its parts or the game's outcomes, and turns by
#      step); each run's report.md and its plots (`megarl report`) are copied into $OUT/<run>/.
# OVERRIDES (space-separated megarl overrides, e.g. "data.prompts_per_step=12") go to each run's command line.
# A run stopped at its stage's limit (SIGINT) keeps its metrics and the summary says how many steps ran. With
# ~90 s of start-up and ~2-3 s a step a run needs ~6 minutes: one call of the GPU machine each
# (STAGES=verifiers, then STAGES="textarena summary" with the same OUT on the kept machine).
# The last line is "gpu_environments: PASS" or "gpu_environments: FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, smol_gguf, copy_run
begin gpu_environments 590
smol_gguf
export PYTHONPATH=$PYTHONPATH:$PWD/tests  # the verifiers taskset vf_guess (tests/vf_guess.py), found by its id
export RUNS=/tmp/runs STEPS=${STEPS:-100} DEADLINE=$(( $(date +%s) + BUDGET_S ))

install_envs() {  # vLLM, then the environment libraries (into the machine's Python, beside what it has)
  install_wheels || return 1
  # the vLLM wheel set carries openai 3.x, verifiers 0.4.0 pins openai<3 (vLLM asks >=2.0): keep the envs' 2.54
  rm -rf /tmp/site/openai /tmp/site/openai-3*.dist-info
  if python3 -c "import verifiers, textarena" 2>/dev/null; then
    echo "verifiers and textarena already there"; return 0
  fi
  python3 -m pip install -q --break-system-packages --no-index --find-links /tmp/envwhl verifiers==0.4.0 \
    textarena==0.7.4 websockets==17.4 || return 1
  python3 -c "import verifiers, textarena; print('verifiers', verifiers.__version__)"
}

train_env() {  # train_env NAME [RESERVE_S]: the config's run, stopped with SIGINT RESERVE_S (default 40) before
  # the budget ends (the copy and the summary)
  train_fresh "$1" $(( DEADLINE - $(date +%s) - ${2:-40} )) "parallel_configs/gpu_1xh200_smollm2_$1.yaml" \
    trainer.steps="$STEPS" ${OVERRIDES:-}
}

summary() {
  python3 - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
lines = ["# Environments from libraries on the GPU (perf/gpu_environments.sh)", ""]
trains = {}  # run -> its training steps' metrics (the table's, then the figure's)
for name in ("verifiers", "textarena"):
    path = out / name / "metrics.jsonl"
    if not path.exists():
        lines += [f"## {name}: no metrics", ""]
        continue
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    train = trains[name] = [r for r in rows if "reward/mean" in r]
    keys = [k for k in sorted({k for r in train for k in r})
            if (k.startswith(("reward/", "game/", "verifiers/"))
                and k not in ("reward/mean", "reward/std", "reward/nonfinite"))
            and not k.endswith(("/std", "/max", "/min"))][:8]
    cols = ["reward/mean", *keys, "agent/turns_mean", "agent/sampled_tokens", "time/step", "time/generate"]
    cols = [c for c in cols if any(c in r for r in train)]
    lines += [f"## {name}: {len(train)} steps", "", "| steps | " + " | ".join(cols) + " |",
              "| --- |" + " ---: |" * len(cols)]
    for i in range(0, len(train), 10):
        chunk = train[i:i + 10]
        means = [sum(r.get(c, 0.0) for r in chunk) / len(chunk) for c in cols]
        lines.append(f"| {chunk[0]['step']}-{chunk[-1]['step']} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    for r in rows:
        val = {k: v for k, v in r.items() if k.startswith("val/") and isinstance(v, (int, float))}
        if val:
            lines.append(f"\nvalidation at step {r.get('step')}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(val.items())[:8]))
    lines.append("")
text = "\n".join(lines)
(out / "environments_summary.md").write_text(text)
print(text)

import matplotlib  # noqa: E402 - the figure after the table, which needs no plotting

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

panels = {"verifiers": [("reward/mean", "reward (weighted rubric)"), ("reward/correct", "correct"),
                        ("reward/brevity", "brevity")],
          "textarena": [("reward/mean", "reward (win 1, draw 0, loss -1)"), ("game/win", "win"),
                        ("game/loss", "loss"), ("game/invalid", "invalid move")]}
if trains:
    fig, axes = plt.subplots(1, len(trains), figsize=(6 * len(trains), 4), squeeze=False)
    for ax, (name, train) in zip(axes[0], trains.items()):
        max_turns = json.loads((out / name / "config.json").read_text())["rollout"]["multi_turn"]["max_turns"]
        steps = [r["step"] for r in train]
        for key, label in panels[name]:
            ax.plot(steps, [r.get(key, float("nan")) for r in train], label=label)
        ax.plot(steps, [r["agent/turns_mean"] / max_turns for r in train], label=f"turns per episode / {max_turns}")
        ax.set_title(f"{name}: {len(train)} GRPO steps")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "environments.png", dpi=110)
    print(f"figure: {out / 'environments.png'}")
PY
}

export -f install_envs train_until train_fresh train_env install_wheels summary copy_run
stage install 300 install_envs
if [ $failed -eq 0 ]; then
  stage verifiers 590 "train_env verifiers"
  stage textarena 590 "train_env textarena"
fi
stage summary 30 summary
finish gpu_environments
