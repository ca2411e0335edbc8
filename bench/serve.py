#!/usr/bin/env python
"""``python bench/serve.py [FLAGS]``: the same as ``pdserve bench serve [FLAGS]`` from a checkout
(the load generator lives in services/loadtest/; ``--help`` lists the flags)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.services.loadtest.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
