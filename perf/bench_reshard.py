"""Reshard benchmark (thin wrapper of :mod:`megarl.bench.reshard`; ``--help`` lists the options).

    .venv/bin/python perf/bench_reshard.py --model qwen2.5-0.5b --nproc 4 --src-tp 2 --dst-tp 2 --json out.json
    .venv/bin/python perf/bench_reshard.py micro --model qwen2.5-7b --device cuda --json micro.json
"""

import sys

from megarl.bench.reshard import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
