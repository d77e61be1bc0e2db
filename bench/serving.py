"""Serving benchmark: ``python bench/serving.py [--compare] [--ttft-overhead] ...``.

The same as ``pdserve bench`` (router/bench.py; the load generator is router/loadgen.py):
N requests through gRPC streaming against a running server (``--server``) or clusters it
starts; TTFT/TPOT/ITL/e2e p50/p90/p99, throughput, goodput under TTFT/TPOT targets; a table,
then one flat JSON object as the last stdout line. ``--ttft-overhead`` adds
``cluster_ttft_overhead_ms_512``; ``--compare`` adds ``p99_tpot_ratio_disagg_vs_colocated``.
"""

from __future__ import annotations

import os
import sys

# `python bench/serving.py` puts bench/ first on sys.path, where bench/engine.py would shadow the
# `engine` package: drop the script's directory and make sure the repo root is importable.
_HERE = os.path.dirname(os.path.realpath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from router.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
