"""`pdserve certs` (services/deployment/certs.py) without a deployment: what it writes, what it
refuses (bad hosts, bounds, an existing key, a CA others could read or swap), and a second run
signing a new host with the same CA. tests/e2e/test_certs_deployment.py runs a deployment on them."""
from __future__ import annotations

import os
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdserve.services.deployment.certs import MAX_NAMES_PER_HOST, CertsConfig, make_certs


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_a_ca_and_a_certificate_per_host_with_its_names_and_both_usages(tmp_path) -> None:
    out = tmp_path / "certs"
    made = make_certs(CertsConfig(out=str(out), hosts=("10.0.0.1", "node2.example,10.0.0.2,fd00::2"), days=30))
    assert made.ca_made and set(made.hosts) == {"10.0.0.1", "node2.example"}
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        n: 0o600 for n in ("ca.pem", "ca.key", "10.0.0.1.pem", "10.0.0.1.key", "node2.example.pem",
                           "node2.example.key")}
    ca, leaf = _cert(out / "ca.pem"), _cert(out / "node2.example.pem")
    leaf.verify_directly_issued_by(ca)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node2.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.2", "fd00::2"]
    usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days in (30, 31)   # backdated an hour

    again = make_certs(CertsConfig(out=str(out), hosts=("10.0.0.3",)))     # a host added later: the same CA
    assert not again.ca_made and _cert(out / "ca.pem") == ca
    _cert(out / "10.0.0.3.pem").verify_directly_issued_by(ca)
    with pytest.raises(ValueError, match="10.0.0.1.pem exists: pass --force"):
        make_certs(CertsConfig(out=str(out), hosts=("10.0.0.1",)))
    old = (out / "10.0.0.1.key").read_bytes()
    make_certs(CertsConfig(out=str(out), hosts=("10.0.0.1",), force=True))
    assert (out / "10.0.0.1.key").read_bytes() != old and _cert(out / "ca.pem") == ca   # the CA is kept


@pytest.mark.parametrize("kwargs, needle", [
    ({"hosts": ()}, "at least one --host"),
    ({"out": ""}, "--out DIR is required"),
    ({"hosts": ("not a name!",)}, "neither an IP address nor a DNS name"),
    ({"hosts": (",".join(f"10.0.0.{i}" for i in range(MAX_NAMES_PER_HOST + 1)),)}, f"at most {MAX_NAMES_PER_HOST}"),
    ({"hosts": ("a.example", "a.example,10.0.0.1")}, "share the files a.example.pem"),
    ({"hosts": ("ca",)}, "share the files ca.pem"),
    ({"days": 0}, "--days must be 1-3650"),
    ({"ca_days": 10**6}, "--ca-days must be 1-7300"),
    ({"hosts": ("x" * 300,)}, "'xxxx"),
])
def test_bad_settings_name_the_flag_and_the_limit(tmp_path, kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        CertsConfig(**{"out": str(tmp_path / "c"), "hosts": ("10.0.0.1",), **kwargs})
    assert len(str(err.value)) < 300   # a short prefix of a long value, never all of it


def test_a_ca_others_could_read_or_swap_is_refused(tmp_path) -> None:
    out = tmp_path / "certs"
    make_certs(CertsConfig(out=str(out), hosts=("10.0.0.1",)))
    os.chmod(out / "ca.key", 0o644)
    with pytest.raises(ValueError, match="ca.key: readable or writable by group or others \\(mode 0644\\)"):
        make_certs(CertsConfig(out=str(out), hosts=("10.0.0.2",)))
    os.chmod(out / "ca.key", 0o600)
    (out / "ca.key").rename(out / "real.key")
    (out / "ca.key").symlink_to(out / "real.key")
    with pytest.raises(ValueError, match="a symbolic link is refused"):
        make_certs(CertsConfig(out=str(out), hosts=("10.0.0.2",)))
    (out / "ca.key").unlink()
    with pytest.raises(ValueError, match="has ca.pem but not the other"):
        make_certs(CertsConfig(out=str(out), hosts=("10.0.0.2",)))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="others cannot write"):
        make_certs(CertsConfig(out=str(shared), hosts=("10.0.0.1",)))
    assert list(shared.iterdir()) == []
