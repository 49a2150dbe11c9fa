"""The SFT demonstrations of the "#### N" format task (perf/RESULTS.md, "SFT then RL on the CPU (issue 45)").

The task is the arithmetic task's questions (:mod:`megarl.data.arithmetic`) with :data:`INSTRUCTION` appended
(``data.instruction`` of ``parallel_configs/cpu_smollm2_rl_after_sft.yaml``), scored by ``reward.fn=gsm8k`` with
``strict: true``: only an answer after "####" counts. A demonstration is a training row's prompt, exactly as the RL
run renders it, and the completion ``#### <sum>``. The first ``--train`` training rows are the demonstrations and
the next ``--val`` ones the validation rows (the held-out test rows are never used).

    python perf/sft_format_demos.py --out data/sft_format [--train 32 --val 32]

writes ``<out>/train.jsonl`` and ``<out>/val.jsonl`` (``{"prompt": str, "completion": str}`` a line; refused if
either exists).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.data.arithmetic import arithmetic_rows

INSTRUCTION = 'Write "####" before the number.'


def demonstrations(train: int = 32, val: int = 32) -> dict[str, list[dict[str, str]]]:
    """The first ``train`` training rows of the arithmetic task as demonstrations and the next ``val`` as
    validation rows: split -> ``[{"prompt": question + " " + INSTRUCTION, "completion": "#### <sum>"}]``."""
    rows = arithmetic_rows()["train"]
    demo = [{"prompt": f"{r['question']} {INSTRUCTION}", "completion": f"#### {r['ground_truth']}"} for r in rows]
    return {"train": demo[:train], "val": demo[train:train + val]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--train", type=int, default=32, help="demonstrations")
    parser.add_argument("--val", type=int, default=32, help="validation rows")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, split_rows in demonstrations(args.train, args.val).items():
        path = out / f"{split}.jsonl"
        with open(path, "x") as f:  # never replace a file
            f.writelines(json.dumps(r) + "\n" for r in split_rows)
        print(f"wrote {len(split_rows)} rows to {path}")


if __name__ == "__main__":
    main()
