"""Online serving benchmark against a live server: `pagedserve.bench.loadgen` as a script.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    python benchmarks/serve.py --sweep-rates 1,2,4,8 --result-json sweep.json

See pagedserve/bench/loadgen.py for the workload, arrivals and metrics.
"""

from __future__ import annotations

import sys

from pagedserve.bench.loadgen import main

if __name__ == "__main__":
    sys.exit(main())
