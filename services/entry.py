"""The `pdserve` console script. Loading the CLI imports torch and transformers (seconds on a small
machine), so on a terminal it first says so on a line that disappears once they are loaded, and
`pdserve --version` answers without loading them at all."""
from __future__ import annotations

import sys


def main() -> int:
    argv = sys.argv[1:]
    if argv == ["--version"]:
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"pdserve {version('pdserve')}")
        except PackageNotFoundError:
            print("pdserve unknown (not installed)")
        return 0
    tty = sys.stderr.isatty()
    if tty:
        sys.stderr.write("pdserve: loading torch and transformers ...")
        sys.stderr.flush()
    try:
        from services.cli import main as cli_main
    finally:
        if tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
