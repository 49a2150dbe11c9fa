"""The memory plans of sweep files over several job sizes, as Markdown tables (perf/RESULTS.md, issue 43).

    PYTHONPATH=$PWD python perf/plan_sweeps.py parallel_configs/sweeps/gpu_64xh200_qwen3-32b.yaml --nodes 1 2 4 8

``megarl sweep FILE --plan`` at each ``job.nodes`` (the file's ``gpus_per_node``), one row per layout: the
estimated GiB per rank where it fits (``megarl.launch.memory``), else why the point is dropped; then the parts of
the estimate at the largest job. Runs no training.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from megarl.launch.memory import GIB
from megarl.launch.submit import JobShape
from megarl.launch.sweep import check_point, device_memory, expand, load_sweep

PARTS = ("params", "grads", "optimizer", "reference", "activations", "rollout", "runtime")


def why(reason: str) -> str:
    """A short form of a drop reason."""
    for pattern, short in ((r"^estimated memory ([\d.]+) GiB", r"\1 over"), (r"^rollout\.tp: vLLM's weights are "
                           r"([\d.]+) GiB", r"vLLM weights \1 GiB over its share"),
                           (r"pp=(\d+) does not divide num_layers=(\d+)", r"pp \1 ∤ \2 layers"),
                           (r"tp=(\d+) does not divide the query groups num_kv_heads=(\d+)", r"tp \1 ∤ \2 KV heads"),
                           (r"mesh needs .* = (\d+) \(times dp\)", r"mesh \1 ∤ world"),
                           (r"ep: (\d+) does not divide the actor's tp=(\d+) x dp=(\d+)", r"ep \1 ∤ tp x dp \2x\3")):
        m = re.search(pattern, reason)
        if m:
            return m.expand(short)
    return reason[:60]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    a = p.parse_args()
    spec = load_sweep(a.sweep)
    cells, largest = {}, {}
    for nodes in a.nodes:
        shape = JobShape(nodes, spec.job.gpus_per_node, spec.job.ntasks_per_node)
        memory = device_memory(spec, shape)
        for point in expand(dataclasses.replace(spec, job=dataclasses.replace(spec.job, nodes=nodes))):
            check_point(spec, point, shape, memory)
            est = point.estimate
            fit = f"**{est.total / GIB:.1f}**" if point.reason is None else why(point.reason)
            if est is not None and point.reason and est.total > memory and not point.reason.startswith("estimated"):
                fit = f"{est.total / GIB:.1f} over; {fit}"  # vLLM's weights dropped it before the total
            cells.setdefault(point.name, {})[shape.world_size] = fit.replace("vLLM weights", "vLLM")
            if nodes == max(a.nodes):
                largest[point.name] = point
    worlds = sorted({w for row in cells.values() for w in row})
    print(f"| layout | {' | '.join(f'{w} GPUs' for w in worlds)} |\n|---|{'---|' * len(worlds)}")
    for name, row in cells.items():
        print(f"| {name} | {' | '.join(row.get(w, '') for w in worlds)} |")
    print(f"\n| layout ({worlds[-1]} GPUs), GiB | {' | '.join(PARTS)} | total | |\n|---|{'---|' * (len(PARTS) + 2)}")
    for name, point in largest.items():
        est = point.estimate
        if est is not None:
            parts = " | ".join(f"{getattr(est, k) / GIB:.1f}" for k in PARTS)
            host = f", host {est.host / GIB:.0f}" if est.host else ""
            fit = "fits" + host if point.reason is None else why(point.reason)
            print(f"| {name} | {parts} | {est.total / GIB:.1f} | {fit} |")


if __name__ == "__main__":
    main()
