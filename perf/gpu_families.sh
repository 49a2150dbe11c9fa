#!/usr/bin/env bash
# The model families of issue 43 on vLLM (tests/test_gpu_families.py), one pytest per family and check, from the
# repo root:
#   bash perf/gpu_families.sh                                   every family, the decode check then the GRPO step
#   FAMILIES="deepseek_v3 gpt_oss" KINDS=decode bash perf/gpu_families.sh
#
# Before it, the vLLM 0.24.0 wheels must be in /tmp/whl and .whl carried (perf/install_wheels.sh). Each family's
# check is its own stage (its own pytest, ~40 s each: one vLLM start), so that a failure prints its traceback
# (--tb=short) and a call cut by the budget keeps what ran: KINDS "decode" (vLLM, with the reshard's weights,
# decodes greedily as the Megatron actor does, parting only at bf16 ties, and its sampled-token log-probs near
# the actor's) and "grpo" (two GRPO steps of `megarl train` with vLLM rollouts, the mismatch logged). The eleven
# cases and both kinds take about two 10-minute calls: KINDS=decode, then KINDS=grpo. Logs go to $OUT (default
# runs/gpu_families); the lines the tests print (per family: greedy agreement, ties in bf16 steps, log-prob
# difference, reward and mismatch of the GRPO steps) are collected at the end. Last line: "gpu_families: PASS" or
# "gpu_families: FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels
begin gpu_families 585

FAMILIES=${FAMILIES:-"qwen3 qwen3_untied phi3 phi4 gemma3 deepseek_v3 glm4_moe gpt_oss qwen3_5 qwen3_5_moe qwen3_next"}
KINDS=${KINDS:-"decode grpo"}
export TEST=tests/test_gpu_families.py

family_check() {  # family_check KIND FAMILY: that one test of tests/test_gpu_families.py
  local test
  case "$1" in
    decode) test=test_vllm_decodes_greedily_like_the_megatron_actor ;;
    grpo) test=test_a_grpo_step_runs_with_vllm_rollouts ;;
    *) echo "unknown KIND $1 (decode or grpo)"; return 2 ;;
  esac
  python3 -m pytest -q -s -p no:cacheprovider -m gpu --tb=short "$TEST::$test[$2]"
}

export -f install_wheels family_check

stage install 200 install_wheels
if [ $failed -eq 0 ]; then  # every check runs, so that one call reports on each
  for kind in $KINDS; do
    for family in $FAMILIES; do
      stage "${kind}_$family" 180 "family_check $kind $family"
    done
  done
fi
grep -h "on vLLM" "$OUT"/*.log 2>/dev/null
finish gpu_families
