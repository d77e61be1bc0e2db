"""pdserve's benchmarks: scripts (``python bench/X.py`` or ``python -m bench.X``) and the
serving benchmark's modules (loadgen.py, serving.py, plots.py, ttft_overhead.py).

``python bench/engine.py`` puts bench/ first on ``sys.path``, where engine.py would shadow the
``engine`` package (and quant.py, serving.py... any top-level name). Every script therefore
imports this package first (``import bench``): importing it takes the folder off ``sys.path``,
before anything else is imported. The package itself is found through the install (``pip
install -e .``), never through that folder, which holds no ``bench`` of its own.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
