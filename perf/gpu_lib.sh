# Shared by the staged GPU scripts (perf/gpu_{dapo,moe,multi,resume,vllm}.sh; sourced, from the repo root): the
# output folder and environment, stages within a budget of wall time, the install and build stages' usual
# functions (a script with its own defines it after sourcing this), and the last line.

begin() {  # begin NAME BUDGET_S: OUT (default runs/NAME, made absolute, exported), perf/gpu_env.sh, the budget
  OUT=${OUT:-runs/$1}
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
  export OUT
  source perf/gpu_env.sh
  BUDGET_S=${BUDGET_S:-$2}
  START=$SECONDS
  failed=0
}

stage() {  # stage NAME LIMIT_S FUNCTION: run it within min(LIMIT_S, budget left), log to $OUT/NAME.log
  # (STAGES="a b ...": only those stages, and install / build, which skip themselves when done; a script whose
  # stages do not fit one call of the GPU machine runs in several calls on a kept machine with one OUT)
  local name=$1 limit=$2 fn=$3 t=$SECONDS rc
  case " install build ${STAGES:-$name} " in *" $name "*) ;; *) echo "SKIP $name (not in STAGES)"; return;; esac
  local left=$(( BUDGET_S - (SECONDS - START) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then echo "FAIL $name (no time left of the ${BUDGET_S} s budget)"; failed=1; return; fi
  timeout "$limit" bash -c "$fn" > "$OUT/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "PASS $name ($(( SECONDS - t )) s): $(tail -n 1 "$OUT/$name.log")"
  else
    [ $rc -eq 124 ] && echo "(timed out after $limit s)" >> "$OUT/$name.log"
    echo "FAIL $name (exit $rc, $(( SECONDS - t )) s); last lines of $OUT/$name.log:"
    tail -n 40 "$OUT/$name.log" | sed 's/^/    /'
    failed=1
  fi
}

install_wheels() {  # the wheels of /tmp/whl and .whl/ into /tmp/site (perf/install_wheels.sh), pytest with them
  bash perf/install_wheels.sh && python3 -c "import pytest"
}

build_extension() {  # megarl._C in place (perf/build_C.sh; skipped when built from the same sources)
  bash perf/build_C.sh
}

copy_run() {  # copy_run NAME: the records of the run $RUNS/NAME (metrics, summary, report and its plots,
  # samples, config) into $OUT/NAME
  mkdir -p "$OUT/$1"
  for f in metrics.jsonl summary.json report.md samples.jsonl val_samples.jsonl config.json; do
    [ -f "$RUNS/$1/$f" ] && cp "$RUNS/$1/$f" "$OUT/$1/"
  done
  cp "$RUNS/$1"/*.png "$OUT/$1/" 2>/dev/null
  [ -d "$RUNS/$1/report" ] && mkdir -p "$OUT/$1/report" && cp "$RUNS/$1"/report/*.png "$OUT/$1/report/" 2>/dev/null
  return 0
}

train_until() {  # train_until NAME STOP_S CONFIG [OVERRIDES...]: `megarl train CONFIG` as the run $RUNS/NAME,
  # stopped with SIGINT (megarl's Ctrl-C: a clean stop that keeps the metrics and writes the summary) after STOP_S
  # seconds; then copy_run NAME. Exit status: the run's (124 where it was stopped)
  local name=$1 stop=$2 config=$3
  shift 3
  [ "$stop" -gt 0 ] || { echo "$name: no time left for the run"; return 1; }
  # bash -c execs python3 itself, so the SIGINT reaches it (and tests/test_perf_scripts.py's python3 stub applies)
  timeout --signal=INT "$stop" bash -c 'python3 -m megarl.cli train "$@"' train "$config" run.output_dir="$RUNS" \
    run.name="$name" trainer.progress=false "$@"
  local rc=$?
  copy_run "$name"
  return $rc
}

train_fresh() {  # train_fresh NAME STOP_S CONFIG [OVERRIDES...]: train_until as a new run (an earlier $RUNS/NAME
  # removed first); a run stopped at STOP_S counts as done (exit status 0; its summary counts the steps)
  rm -rf "${RUNS:?}/$1"
  train_until "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "$1: stopped at the stage's limit (the summary counts the steps)" && rc=0
  return $rc
}

train_resumable() {  # train_resumable NAME CONFIG [OVERRIDES...]: train_until, resumed from the run's last
  # checkpoint when it has one, stopped 30 s before $DEADLINE so that the next call on the same machine resumes it
  local name=$1 config=$2 resume=()
  shift 2
  ls "$RUNS/$name/checkpoints" 2>/dev/null | grep -q step_ && resume=(--resume)
  train_until "$name" $(( DEADLINE - $(date +%s) - 30 )) "$config" "$@" "${resume[@]}"
}

synthetic_task() {  # synthetic_task DIR [N]: the synthetic task of tests/rl_tasks.py in DIR, made once: its word-level
  # tokenizer (DIR/tok) and N (default 4096) prompts of 3-5 words (DIR/prompts.jsonl); SYN, the overrides that
  # train on it (that tokenizer, those prompts as they are, the says_target reward)
  SYN=(model.tokenizer="$1/tok" "data.train_files=[$1/prompts.jsonl]" data.prepare=null data.use_chat_template=false
       "data.instruction=''" reward.fn=tests.rl_tasks:says_target)
  [ -f "$1/prompts.jsonl" ] && return 0
  mkdir -p "$1"
  python3 -c "
from pathlib import Path
from tests.rl_tasks import make_tiny_model, write_prompts
make_tiny_model(Path('$1/tok')); write_prompts(Path('$1/prompts.jsonl'), ${2:-4096})"
}

smol_gguf() {  # export SMOL_GGUF (default /tmp/smol.gguf), joined from its uploaded pieces where needed: the
  # slices in /tmp/sm once the last, with its checksum, is there (.gpu/up/sNN), or /tmp/smol.gguf.part-aa and -ab
  # (.gpu/smol/p1 and p2); both made by perf/stage_uploads.sh
  export SMOL_GGUF=${SMOL_GGUF:-/tmp/smol.gguf}
  if [ ! -f "$SMOL_GGUF" ] && [ -f /tmp/sm/smol.sha256 ]; then
    cat /tmp/sm/smol.part[0-9]* > "$SMOL_GGUF"
    [ "$(sha256sum < "$SMOL_GGUF" | cut -d' ' -f1)" = "$(cut -d' ' -f1 /tmp/sm/smol.sha256)" ] || rm -f "$SMOL_GGUF"
  elif [ ! -f "$SMOL_GGUF" ] && [ -f /tmp/smol.gguf.part-aa ] && [ -f /tmp/smol.gguf.part-ab ]; then
    cat /tmp/smol.gguf.part-aa /tmp/smol.gguf.part-ab > "$SMOL_GGUF"
  fi
}

finish() {  # finish NAME: the last line, "NAME: PASS" or "NAME: FAIL", and the exit status 0 or 1
  if [ "$failed" -eq 0 ]; then echo "$1: PASS ($(( SECONDS - START )) s)"; exit 0; fi
  echo "$1: FAIL ($(( SECONDS - START )) s; logs in $OUT)"
  exit 1
}
