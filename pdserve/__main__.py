"""``python -m pdserve``: the ``pdserve`` command."""
from pdserve.services.cli.entry import main

raise SystemExit(main())
