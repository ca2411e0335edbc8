"""A throwaway CA and a certificate for 127.0.0.1 (or given addresses), for mutual-TLS tests, made
by the same code as `pdserve certs` (services/deployment/certs.py)."""
from __future__ import annotations

import ipaddress
from pathlib import Path

from pdserve.services.deployment.certs import HostNames, new_ca, new_leaf, pem_cert, pem_key


def make_ca_and_cert(out: Path, cn: str = "pdserve-test", ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, Path]:
    """ca.pem, cert.pem (signed by the CA, SAN the ips and localhost), key.pem; another CA's
    cert and key (other-cert.pem, other-key.pem) to play a stranger."""
    host = HostNames(cn, tuple(ipaddress.ip_address(ip) for ip in ips), ("localhost",))
    paths = {}
    for label, prefix in (("deployment", ""), ("stranger", "other-")):
        ca_key, ca_cert = new_ca(f"{cn} {label} CA", days=1)
        key, cert = new_leaf(ca_key, ca_cert, host, days=1)
        for name, data in ((f"{prefix}ca.pem", pem_cert(ca_cert)), (f"{prefix}cert.pem", pem_cert(cert)),
                           (f"{prefix}key.pem", pem_key(key))):
            (out / name).write_bytes(data)
            paths[name] = out / name
    return paths
