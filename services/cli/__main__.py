"""`python -m services.cli`: the `pdserve` command line."""
import sys

from services.cli.commands import main

sys.exit(main())
