#!/usr/bin/env bash
# Agentic RL on the H200 (issue 29), in one command from the repo root:   bash perf/gpu_agentic.sh
#
# Needs what perf/gpu_dapo.sh needs: the vLLM wheels (perf/install_wheels.sh: chunks uploaded to /tmp/whl;
# skipped on a kept machine where they import), the SmolLM2-135M GGUF (SMOL_GGUF, default /tmp/smol.gguf) and
# GSM8K (GSM8K_DIR, default /tmp/gsm8k; perf/gpu_smollm2_gsm8k.sh). Stages:
#   1. install: the wheels into /tmp/site (skipped when already done); no megarl._C build (84 s on a fresh
#      machine): the 135M model's colocated TP 1 -> TP 1 weight sync takes the pure-torch box copies;
#   2. agentic: parallel_configs/gpu_1xh200_smollm2_gsm8k_tools.yaml, GRPO on GSM8K with the calculator tool
#      over up to 3 turns, STEPS (default 100) steps of 16 prompts x 8 episodes, vLLM driven request by request
#      (prefix caching on); greedy validation by episodes on 128 GSM8K test problems before step 1 and after
#      the last step; report.md and its plots at the end;
#   3. single: the same config and the same model, back to back, with one turn per sample
#      (rollout.multi_turn.enabled=false) and rollout.max_new_tokens = the multi-turn run's mean sampled tokens
#      per episode over its last 10 steps (the same tokens per sample), 10 steps from the start, no validation;
#   4. summary: $OUT/agentic_summary.md: a table by 10 steps (reward, accuracy, tool-use rate, tool calls and
#      errors per episode, turns, sampled and observation tokens, prefix-cache hit rate, |rollout - old
#      log-prob| on sampled tokens, step and generate seconds), the validation before and after (accuracy, tool
#      use), $OUT/agentic.png (reward, tool use and validation accuracy by step), and the cost of turns: generate
#      tokens/s of the multi-turn steps against the single-turn run's (its steps 2-10), and |rollout - old
#      log-prob| of the multi-turn samples against the single-turn ones.
# $OUT (default runs/gpu_agentic) receives the logs, both runs' metrics.jsonl, samples, validation samples,
# report.md and plots. Measured on one H200 (2026-12-02, perf/RESULTS.md): ~1.5 min start-up per run (GGUF load,
# vLLM with CUDA graphs), 2.0-2.3 s per multi-turn step (128 episodes of <= 384 tokens), the single-turn run of 10
# steps 123 s with its start-up: about 9.5 minutes in all. With less time left, stage
# 2 is stopped cleanly (SIGINT) at its limit and the summary says how many steps ran (STEPS=60 halves it). The
# 100 steps took 391 s of stage 2 on 2026-12-03, about all one call's budget leaves it; to be sure of them, run it
# in two calls on one machine: OUT=/tmp/ag BUDGET_S=680 STAGES=agentic, then OUT=/tmp/ag STAGES="single summary". The last
# line is "gpu_agentic: PASS" or "gpu_agentic: FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, copy_run
begin gpu_agentic 585

source perf/gpu_smollm2_gsm8k.sh  # SMOL_GGUF, GSM8K_DIR
export CONFIG=parallel_configs/gpu_1xh200_smollm2_gsm8k_tools.yaml RUNS=/tmp/runs DATA=/tmp/data/gsm8k
export STEPS=${STEPS:-100}
export DEADLINE=$(( $(date +%s) + BUDGET_S ))

agentic() {  # stopped with SIGINT 150 s before the budget ends (room for stage 3)
  train_fresh agentic $(( DEADLINE - $(date +%s) - 150 )) "$CONFIG" data.gsm8k_source="$GSM8K_DIR" \
    "data.train_files=[$DATA/train.parquet]" "validation.files=[$DATA/test.parquet]" trainer.steps="$STEPS"
}

single() {
  local tokens
  tokens=$(python3 - "$OUT/agentic/metrics.jsonl" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in rows if r["step"] > 0 and "agent/sampled_tokens" in r][-10:]
print(max(1, round(sum(r["agent/sampled_tokens"] for r in steps) / len(steps) / 128)))
EOF
)
  rm -rf "$RUNS/single"
  python3 -m megarl.cli train "$CONFIG" data.gsm8k_source="$GSM8K_DIR" "data.train_files=[$DATA/train.parquet]" \
    run.output_dir="$RUNS" run.name=single trainer.progress=false trainer.report=false validation.enabled=false \
    trainer.steps=10 rollout.multi_turn.enabled=false rollout.max_new_tokens="${tokens:-128}" || return 1
  copy_run single
}

summary() {
  python3 - "$OUT/agentic/metrics.jsonl" "$OUT/single/metrics.jsonl" "$OUT" <<'EOF'
import json
import sys

import numpy as np

read = lambda p: [json.loads(line) for line in open(p) if line.strip()]
rows, single = read(sys.argv[1]), read(sys.argv[2])
steps = [r for r in rows if r["step"] > 0 and "reward/mean" in r]
val = [r for r in rows if "val/accuracy" in r]
cols = [("reward", "reward/mean", "{:.3f}"), ("accuracy", "reward/accuracy", "{:.3f}"),
        ("tool use", "agent/tool_use_rate", "{:.0%}"), ("calls/ep", "agent/tool_calls_per_episode", "{:.2f}"),
        ("errors/ep", "agent/tool_errors", "{:.2f}"), ("turns", "agent/turns_mean", "{:.2f}"),
        ("sampled tok/ep", "agent/sampled_tokens", "{:.0f}"), ("obs tok/ep", "agent/observation_tokens", "{:.0f}"),
        ("prefix hits", "agent/prefix_cache_hit_rate", "{:.0%}"),
        ("rollout-old lp", "actor/rollout_vs_old_logprob_diff", "{:.4f}"),
        ("step s", "time/step", "{:.2f}"), ("generate s", "time/generate", "{:.2f}")]
per_episode = {"agent/tool_errors", "agent/sampled_tokens", "agent/observation_tokens"}
out = ["| steps | " + " | ".join(c for c, _, _ in cols) + " |", "| --- |" + " ---: |" * len(cols)]
for lo in range(1, len(steps) + 1, 10):
    chunk = [r for r in steps if lo <= r["step"] < lo + 10]
    cells = [fmt.format(np.mean([r.get(k, float("nan")) / (128 if k in per_episode else 1) for r in chunk]))
             for _, k, fmt in cols]
    out.append(f"| {lo}-{chunk[-1]['step']} | " + " | ".join(cells) + " |")
out.append("")
for r in val:
    out.append(f"validation at step {r['step']}: accuracy {r['val/accuracy']:.3f} (128 GSM8K test problems, greedy "
               f"episodes), tool use {r.get('val/tool_use_rate', float('nan')):.0%}, turns "
               f"{r.get('val/turns_mean', float('nan')):.2f}")
mt, st = steps[-10:], [r for r in single if r["step"] > 1]
tps = lambda rs: np.mean([r["throughput/generate_tokens_per_s"] for r in rs])
diff = lambda rs: np.mean([r["actor/rollout_vs_old_logprob_diff"] for r in rs])
sampled = np.mean([r["agent/sampled_tokens"] / 128 for r in mt])
single_len = np.mean([r["response/length_mean"] for r in st])
out += ["", f"cost of turns: generate {tps(mt):,.0f} sampled tokens/s over 3 turns (steps {mt[0]['step']}-"
        f"{mt[-1]['step']}, {sampled:.0f} sampled tokens per episode) vs {tps(st):,.0f} tokens/s in one turn "
        f"(steps 2-10 of the same config, {single_len:.0f} tokens per sample): {tps(mt) / tps(st):.2f}x",
        f"|rollout - old log-prob| per sampled token: {diff(mt):.4f} multi-turn vs {diff(st):.4f} single-turn"]
text = "\n".join(out)
open(f"{sys.argv[3]}/agentic_summary.md", "w").write(text + "\n")
print(text)
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["step"] for r in steps]
    ax[0].plot(x, [r["reward/mean"] for r in steps], label="train reward")
    ax[0].plot(x, [r["reward/accuracy"] for r in steps], label="train accuracy")
    ax[0].plot([r["step"] for r in val], [r["val/accuracy"] for r in val], "o-", label="validation accuracy")
    ax[1].plot(x, [r["agent/tool_use_rate"] for r in steps], label="episodes with a tool call")
    ax[1].plot(x, [r["agent/tool_errors"] / 128 for r in steps], label="tool errors per episode")
    ax[1].plot(x, [r["agent/turns_mean"] for r in steps], label="turns per episode")
    for a in ax:
        a.set_xlabel("step")
        a.legend()
    fig.suptitle("SmolLM2-135M, GSM8K with a calculator tool, GRPO on one H200")
    fig.tight_layout()
    fig.savefig(f"{sys.argv[3]}/agentic.png", dpi=110)
except ImportError:
    pass
assert len(steps) >= 100, f"{len(steps)} steps logged (fewer than 100: run again with more time, or STEPS=...)"
EOF
}

export -f copy_run train_until train_fresh agentic single summary

stage install 200 "bash perf/install_wheels.sh"
if [ $failed -eq 0 ]; then
  stage agentic 600 agentic  # whatever is left of the budget but 150 s
  stage single 150 single
  [ $failed -eq 0 ] && stage summary 60 summary
fi
[ -f "$OUT/agentic_summary.md" ] && cat "$OUT/agentic_summary.md"
finish gpu_agentic
