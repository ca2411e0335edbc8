"""A throwaway CA and a certificate for 127.0.0.1 (or given addresses), for mutual-TLS tests."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca_and_cert(out: Path, cn: str = "pdserve-test", ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, Path]:
    """ca.pem, cert.pem (signed by the CA, SAN the ips and localhost), key.pem; another CA's
    cert and key (other-cert.pem, other-key.pem) to play a stranger."""
    now = datetime.datetime.now(datetime.timezone.utc)
    paths = {}

    def ca(label: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(f"{cn} {label} CA")).issuer_name(_name(f"{cn} {label} CA"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(ca_key, ca_cert):
        key = ec.generate_private_key(ec.SECP256R1())
        san = x509.SubjectAlternativeName([*(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
                                           x509.DNSName("localhost")])
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
        return key, cert

    for label, prefix in (("deployment", ""), ("stranger", "other-")):
        ca_key, ca_cert = ca(label)
        key, cert = leaf(ca_key, ca_cert)
        for name, data in ((f"{prefix}ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM)),
                           (f"{prefix}cert.pem", cert.public_bytes(serialization.Encoding.PEM)),
                           (f"{prefix}key.pem", _pem_key(key))):
            (out / name).write_bytes(data)
            paths[name] = out / name
    return paths
