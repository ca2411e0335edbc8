"""`python -m services.cli`: the `pdserve` command line."""
import sys

from pdserve.services.cli.commands import main

sys.exit(main())
