#!/usr/bin/env python
"""``python bench/offline_throughput.py [FLAGS]``: the same as ``pdserve bench offline [FLAGS]`` from
a checkout (the workload and both runners live in services/loadtest/offline.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.services.loadtest.offline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
