"""`pdserve certs --out DIR --host IP|NAME[,IP|NAME...] ...`: a deployment CA and a certificate per
host for mutual TLS (services/deployment/certs.py). Importing this module imports no cryptography:
the handler and the flag builder do."""
from __future__ import annotations

import argparse

from pdserve.services.common.config_flags import add_config_args, config_from_args


def add_certs_args(p: argparse.ArgumentParser) -> None:
    # lazy: cryptography only when this runs
    from pdserve.services.deployment.certs import CertsConfig, MAX_HOSTS, MAX_NAMES_PER_HOST
    add_config_args(p, CertsConfig)
    p.add_argument("--host", action="append", dest="hosts", metavar="IP|NAME[,IP|NAME...]",
                   help=f"a host the deployment runs on, repeatable (at most {MAX_HOSTS}): the IP addresses and DNS "
                        f"names (at most {MAX_NAMES_PER_HOST}) its certificate is valid for; its files are named "
                        f"after the first")
    p.set_defaults(func=cmd_certs)


def cmd_certs(args: argparse.Namespace) -> int:
    from pdserve.services.deployment.certs import CertsConfig, make_certs   # lazy: cryptography only when this runs
    config = config_from_args(CertsConfig, args, hosts=tuple(args.hosts or ()))
    print(make_certs(config).describe(), flush=True)
    return 0
