#!/usr/bin/env bash
# The post-training workflow's GPU parts on one H100/H200 (issue 45), from the repo root:   bash perf/gpu_workflow.sh
#
# Needs the vLLM wheels in /tmp/whl (as perf/gpu_vllm.sh; carry .whl) and the SmolLM2-135M GGUF (SMOL_GGUF,
# default /tmp/smol.gguf, or its two halves, perf/gpu_smollm2_gsm8k.sh); GSM8K (GSM8K_DIR with train.jsonl and
# test.jsonl, default /tmp/gsm8k, else the carried .gpu/smol/p2/gsm8k) is optional: without it the judge stage
# trains on the arithmetic task. Stages:
#   1. install: the vLLM wheels into /tmp/site (skipped when done);
#   2. judge: SmolLM2-135M-Instruct as a generative judge (reward.judge), served by vLLM's OpenAI-compatible
#      server on the same GPU (JUDGE_GPU_MEM, default 0.15 of its memory, a context of 2048; the GGUF written
#      as a bf16 Hugging Face folder with its tokenizer first, JUDGE_DIR, default /tmp/smol_judge_hf), then
#      JUDGE_STEPS (default 10) GRPO steps of parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml (16 prompts x 8)
#      with the reward 0.5 x judge + 1.0 x the rule reward, the rollout engine at 0.25 of the GPU; the server is
#      stopped at the stage's end;
#   3. teacher: parallel_configs/gpu_1xh200_smollm2_opd_teacher.yaml, the CPU main job's recipe (GRPO on the
#      arithmetic task, 15 steps) with vLLM rollouts, validated before and after, its last checkpoint kept;
#   4. opd: parallel_configs/gpu_1xh200_smollm2_opd.yaml, on-policy distillation of a fresh student from that
#      checkpoint (OPD_TEACHER: another teacher), 15 steps, greedy validation before step 1 and every 3 steps;
#   5. summary: $OUT/workflow_summary.md: per step the judge's and the rule reward's seconds, the judge's
#      requests and unreadable verdicts; OPD's reverse KL by step and its validation accuracy against the
#      teacher's. Each run's records (metrics, report, plots) are copied into $OUT/<run>/.
# A run stopped at its stage's limit (SIGINT) keeps its metrics and the summary counts its steps. Stages share a
# budget of 450 s of wall time (BUDGET_S), each within its limit (JUDGE_S 240, TEACHER_S 180, OPD_S 200); with
# ~60-90 s of start-up a run, on a fresh machine run STAGES=judge first (with the install), then
# STAGES="teacher opd summary" with the same OUT on the kept machine.
# The last line is "gpu_workflow: PASS" or "gpu_workflow: FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, smol_gguf, copy_run
begin gpu_workflow 450
smol_gguf
GSM8K_DIR=${GSM8K_DIR:-/tmp/gsm8k}
[ -f "$GSM8K_DIR/train.jsonl" ] || [ ! -f .gpu/smol/p2/gsm8k/train.jsonl ] || GSM8K_DIR=$PWD/.gpu/smol/p2/gsm8k
export GSM8K_DIR RUNS=${RUNS:-/tmp/runs/workflow} JUDGE_DIR=${JUDGE_DIR:-/tmp/smol_judge_hf} \
  JUDGE_PORT=${JUDGE_PORT:-8011} JUDGE_GPU_MEM=${JUDGE_GPU_MEM:-0.15} JUDGE_STEPS=${JUDGE_STEPS:-10} \
  DEADLINE=$(( $(date +%s) + BUDGET_S ))
JUDGE_S=${JUDGE_S:-240} TEACHER_S=${TEACHER_S:-180} OPD_S=${OPD_S:-200}  # each stage's limit, seconds

seconds_left() {  # seconds_left STARTED LIMIT RESERVE: until the stage that began at STARTED (date +%s) with
  # LIMIT s reaches its end (or the budget's), less RESERVE (the copy of the run's records)
  local now; now=$(date +%s)
  local left=$(( $1 + $2 - now )) budget=$(( DEADLINE - now ))
  [ "$budget" -lt "$left" ] && left=$budget
  echo $(( left - $3 ))
}

judge_model() {  # the GGUF as a bf16 Hugging Face folder with its tokenizer (vLLM serves a folder), once
  [ -f "$JUDGE_DIR/config.json" ] && [ -f "$JUDGE_DIR/tokenizer_config.json" ] && return 0
  python3 - "$SMOL_GGUF" "$JUDGE_DIR" <<'PY'
import sys

import torch

from megarl.models.hf_io import load_tokenizer, open_hf_checkpoint, save_hf_checkpoint

gguf, out = sys.argv[1], sys.argv[2]
ckpt = open_hf_checkpoint(gguf)  # dequantised by transformers
# the config's end of turn (<|im_end|>) as vLLM's stop token: the GGUF's tokenizer names <|im_start|> as its eos
save_hf_checkpoint(out, ckpt.spec, {n: ckpt.read(n).to(torch.bfloat16) for n in ckpt.tensor_names},
                   generation_config={"eos_token_id": ckpt.hf_config.get("eos_token_id")})
load_tokenizer(gguf).save_pretrained(out)  # with the chat template the GGUF carries
print(f"judge model: {out}")
PY
}

stop_judge() {  # the judge server's process group (the API server and its engine process), TERM, then KILL after 30 s
  [ -n "${JUDGE_PID:-}" ] || return 0
  kill -- -"$JUDGE_PID" 2>/dev/null
  local waited=0
  while kill -0 "$JUDGE_PID" 2>/dev/null && [ $waited -lt 30 ]; do sleep 1; waited=$(( waited + 1 )); done
  kill -9 -- -"$JUDGE_PID" 2>/dev/null
  wait "$JUDGE_PID" 2>/dev/null
  JUDGE_PID=
}

judge() {  # the judge server, then the run scored by it; the server is stopped when the stage ends
  local started rc; started=$(date +%s)
  judge_model || return 1
  set -m  # the server and its engine process in a group of their own, stopped whole (stop_judge)
  VLLM_ENABLE_V1_MULTIPROCESSING=1 python3 -m vllm.entrypoints.openai.api_server --model "$JUDGE_DIR" \
    --served-model-name judge --host 127.0.0.1 --port "$JUDGE_PORT" --dtype bfloat16 \
    --gpu-memory-utilization "$JUDGE_GPU_MEM" --max-model-len 2048 --enforce-eager > "$OUT/judge_server.log" 2>&1 &
  JUDGE_PID=$!
  set +m
  trap stop_judge EXIT  # also when the stage's limit ends it
  local url=http://127.0.0.1:$JUDGE_PORT/v1
  until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$url/models" \
      2>/dev/null; do
    kill -0 "$JUDGE_PID" 2>/dev/null || { echo "the judge server exited:"; tail -n 30 "$OUT/judge_server.log"
                                          return 1; }
    sleep 2
  done
  echo "judge server up at $url after $(( $(date +%s) - started )) s"
  local config=parallel_configs/gpu_1xh200_smollm2_opd_teacher.yaml data=()  # arithmetic without GSM8K
  if [ -f "$GSM8K_DIR/train.jsonl" ]; then
    config=parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml
    data=(data.gsm8k_source="$GSM8K_DIR" "data.train_files=[/tmp/data/gsm8k/train.parquet]"
          data.prompts_per_step=16 actor.ppo_mini_batch_size=128)
  fi
  echo "judge run: $config"
  train_fresh judge "$(seconds_left "$started" "$1" 40)" "$config" "${data[@]}" trainer.steps="$JUDGE_STEPS" \
    trainer.save_every=0 validation.enabled=false rollout.enforce_eager=true rollout.gpu_memory_utilization=0.25 \
    reward.judge.enabled=true reward.judge.url="$url" reward.judge.model=judge reward.judge.weight=0.5 \
    reward.judge.rule_weight=1.0 reward.judge.max_tokens=128 reward.judge.max_concurrency=128
  rc=$?
  stop_judge
  return $rc
}

teacher() {
  train_fresh teacher "$(seconds_left "$(date +%s)" "$1" 15)" parallel_configs/gpu_1xh200_smollm2_opd_teacher.yaml
}

opd() {  # distillation from the teacher stage's newest checkpoint (or OPD_TEACHER)
  local started teacher; started=$(date +%s)
  teacher=${OPD_TEACHER:-$(ls -d "$RUNS"/teacher/checkpoints/step_* 2>/dev/null | sort | tail -n 1)}
  [ -n "$teacher" ] || { echo "no checkpoint in $RUNS/teacher/checkpoints: run the teacher stage first"; return 1; }
  echo "teacher: $teacher"
  train_fresh opd "$(seconds_left "$started" "$1" 15)" parallel_configs/gpu_1xh200_smollm2_opd.yaml \
    algorithm.distill.teacher="$teacher"
}

summary() {
  python3 - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def rows(name):
    path = out / name / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def val(rows_):
    """step -> the validation's accuracy (val/accuracy, else the first val/ figure)."""
    got = {}
    for r in rows_:
        keys = sorted(k for k, v in r.items() if k.startswith("val/") and isinstance(v, (int, float)))
        if keys:
            key = "val/accuracy" if "val/accuracy" in keys else keys[0]
            got[r.get("step", 0)] = (key, r[key])
    return got


def fmt(v):
    return "" if v is None else f"{v:.3f}"


lines = ["# The post-training workflow on the GPU (perf/gpu_workflow.sh)", ""]
judge = [r for r in rows("judge") if "reward/judge_s" in r]
lines += [f"## Generative judge (SmolLM2-135M-Instruct over HTTP): {len(judge)} steps", "",
          "reward = 0.5 x judge + 1.0 x rule reward", "",
          "| step | reward/mean | judge_s | rule_s | requests | unreadable | unreadable share | timeouts | step s |",
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
for r in judge:
    n = r.get("reward/judge_requests") or 0
    unread = r.get("reward/judge_unreadable", 0)
    lines.append(f"| {r['step']} | {fmt(r.get('reward/mean'))} | {fmt(r['reward/judge_s'])} | "
                 f"{r.get('reward/rule_s', 0):.5f} | {n:.0f} | {unread:.0f} | {fmt(unread / n if n else None)} | "
                 f"{r.get('reward/judge_timeouts', 0):.0f} | {fmt(r.get('time/step'))} |")
if judge:
    js = sum(r["reward/judge_s"] for r in judge) / len(judge)
    rs = sum(r.get("reward/rule_s", 0) for r in judge) / len(judge)
    lines.append(f"\nmean judge_s {js:.3f} s, rule_s {rs:.5f} s a step")
lines.append("")
teacher, opd = rows("teacher"), rows("opd")
tval, oval = val(teacher), val(opd)
train = [r for r in opd if "distill/reverse_kl" in r]
lines += [f"## On-policy distillation: teacher {len([r for r in teacher if 'reward/mean' in r])} GRPO steps, "
          f"student {len(train)} OPD steps", "",
          "teacher validation: " + ", ".join(f"step {s}: {v:.3f}" for s, (_, v) in sorted(tval.items())), "",
          "| step | reverse KL | log p_student | log p_teacher | reward/mean | val accuracy |",
          "| ---: | ---: | ---: | ---: | ---: | ---: |"]
if 0 in oval:
    lines.append(f"| 0 | | | | | {oval[0][1]:.3f} |")
for r in train:
    v = oval.get(r["step"])
    lines.append(f"| {r['step']} | {fmt(r['distill/reverse_kl'])} | {fmt(r.get('distill/student_logprob_mean'))} | "
                 f"{fmt(r.get('distill/teacher_logprob_mean'))} | {fmt(r.get('reward/mean'))} | "
                 f"{fmt(v[1] if v else None)} |")
if tval and oval:
    last_t, last_o = tval[max(tval)][1], oval[max(oval)][1]
    lines.append(f"\nthe student's last validation {last_o:.3f} is {last_o / last_t:.0%} of the teacher's {last_t:.3f}"
                 if last_t else "")
text = "\n".join(lines) + "\n"
(out / "workflow_summary.md").write_text(text)
print(text)
PY
}

export -f install_wheels seconds_left train_until train_fresh copy_run judge_model stop_judge judge teacher opd summary
stage install 200 install_wheels
if [ $failed -eq 0 ]; then  # all run, so that one GPU session reports on each
  stage judge "$JUDGE_S" "judge $JUDGE_S"
  stage teacher "$TEACHER_S" "teacher $TEACHER_S"
  stage opd "$OPD_S" "opd $OPD_S"
fi
stage summary 30 summary
finish gpu_workflow
