"""A steady load run inside an emulated host (the test process cannot reach the hosts' addresses):
`python -m tests.e2e.ns_load ROUTER OUT STOP_FILE --seed N` sends fresh greedy prompts until
STOP_FILE exists, then writes every (prompt, tokens) pair, the migrations and the failures to OUT
as JSON. tests.serving.SteadyLoad does the sending."""
from __future__ import annotations

import argparse
import json
import os
import time

from tests.serving import SteadyLoad

MAX_RUN_S = 600.0   # it stops by itself even if nobody creates the stop file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("router")
    p.add_argument("out")
    p.add_argument("stop_file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=2)
    args = p.parse_args()
    deadline = time.monotonic() + MAX_RUN_S
    with SteadyLoad(args.router, clients=args.clients, seed=args.seed) as load:
        while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
            with open(args.out + ".count", "w") as f:   # progress, for the test to wait on
                f.write(str(len(load.outputs)))
            time.sleep(0.1)
    with open(args.out, "w") as f:
        json.dump({"outputs": load.outputs, "failures": load.failures, "migrations": load.migrations,
                   "params": load.params}, f)


if __name__ == "__main__":
    main()
