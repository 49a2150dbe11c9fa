"""``megarl data gsm8k|arithmetic|calculator``: a task's train/test parquet files."""

from __future__ import annotations

import argparse

from megarl.cli.args import OVERWRITE_HELP, command


@command("data", "gsm8k", help="prepare GSM8K (train/test parquet files)")
def _data_gsm8k(p: argparse.ArgumentParser):
    p.add_argument("--src", required=True,
                   help="directory with train.jsonl and test.jsonl, or a Hugging Face hub dataset id ('hub': "
                        "GSM8K's own, megarl.data.gsm8k.HF_REPO)")
    p.add_argument("--out", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.data.gsm8k import prepare_gsm8k

        return _print_written(prepare_gsm8k(a.src, a.out, overwrite=a.overwrite))
    return run


@command("data", "arithmetic", help="write the arithmetic task (train/test parquet files; the CPU main job's data)")
def _data_arithmetic(p: argparse.ArgumentParser):
    p.add_argument("--out", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.data.arithmetic import prepare_arithmetic

        return _print_written(prepare_arithmetic(a.out, overwrite=a.overwrite))
    return run


@command("data", "calculator", help="write the calculator task (5-digit sums for the calculator tool; train/test "
                                   "parquet files)")
def _data_calculator(p: argparse.ArgumentParser):
    p.add_argument("--out", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.data.arithmetic import prepare_calculator

        return _print_written(prepare_calculator(a.out, overwrite=a.overwrite))
    return run


def _print_written(written: dict) -> int:
    """``megarl data``'s report: one line per written split (its file and row count); exit status 0."""
    import pyarrow.parquet as pq

    for split, path in written.items():
        print(f"{split}: {path} ({pq.read_metadata(path).num_rows} problems)")
    return 0
