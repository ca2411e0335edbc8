"""The `pdserve` console script. The CLI imports the engine (torch, transformers: seconds on a
small machine) only in the commands that run it, so `pdserve --help`, `pdserve --version` and the
client commands (`generate --router`, `health`) start at once."""
from __future__ import annotations

import sys

from pdserve.services.cli.commands import main as cli_main



def main() -> int:
    # lazy: cryptography, grpc, numpy, prometheus_client only when this runs
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
