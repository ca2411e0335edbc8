"""`pdserve certs`: a deployment CA and a certificate per host, so that mutual TLS across hosts
(``--tls-cert``, ``--tls-key``, ``--tls-ca``) takes one command, as ``cockroach cert`` and
``nomad tls`` give their users.

``pdserve certs --out DIR --host 10.0.0.1 --host node2.example,10.0.0.2`` writes:

- ``DIR/ca.pem`` and ``DIR/ca.key``: the deployment CA (EC P-256), made on the first run and
  reused afterwards, so that a host added later is signed by the same CA. It is never
  overwritten: a new CA needs a new directory.
- ``DIR/HOST.pem`` and ``DIR/HOST.key`` for each ``--host`` (HOST: its first name, ``:`` as
  ``_``): a certificate whose SANs are every IP address and DNS name the flag lists, for both
  serverAuth and clientAuth (a member is a server to some and a client of others). An existing
  key is refused unless ``--force``.

The directory is made 0700 (an existing one must be ours and not writable by others), every file
is written 0600 through a temporary file and a rename, and an existing CA is read only after
checking it (not a link, a regular file of ours, its key not readable by others, bounded size).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.engine.settings import setting
from pdserve.services.common.checked_files import read_checked

MAX_HOSTS = 256               # --host flags per run
MAX_NAMES_PER_HOST = 16       # SANs per certificate
MAX_DNS_CHARS = 253
MAX_DAYS = 3650               # a host certificate's validity, at most
MAX_CA_DAYS = 7300
MAX_PEM_BYTES = 64 << 10      # an existing CA file larger than this is refused
BACKDATE = datetime.timedelta(hours=1)   # valid from an hour ago: clocks of the hosts may differ
CA_FILES = ("ca.pem", "ca.key")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True, slots=True)
class HostNames:
    """One --host: the SANs of its certificate and the stem of its files."""

    first: str          # the name given first: the certificate's common name
    ips: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]
    dns: tuple[str, ...]

    @property
    def stem(self) -> str:
        """The name of its files: the first name, any character but letters, digits, '.', '-' as '_'."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.first)


def parse_host(text: str) -> HostNames:
    """``IP|NAME[,IP|NAME...]``: the addresses one host is reached at (ValueError naming the bad one)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(parts):
        raise ValueError(f"--host must be IP or DNS names separated by commas, got {text[:80]!r}")
    if len(parts) > MAX_NAMES_PER_HOST:
        raise ValueError(f"--host lists at most {MAX_NAMES_PER_HOST} names, got {len(parts)}")
    ips, dns = [], []
    for part in parts:
        try:
            ips.append(ipaddress.ip_address(part.strip("[]")))
            continue
        except ValueError:
            pass
        name = part.rstrip(".").lower()
        if len(name) > MAX_DNS_CHARS or not all(_LABEL.fullmatch(label) for label in name.split(".")):
            raise ValueError(f"--host: {part[:80]!r} is neither an IP address nor a DNS name (letters, digits "
                             f"and hyphens in dot-separated labels, {MAX_DNS_CHARS} characters at most)")
        dns.append(name)
    return HostNames(parts[0].strip("[]").rstrip(".").lower(), tuple(ips), tuple(dns))


@dataclass(slots=True)
class CertsConfig:
    """`pdserve certs` settings; --host is a repeatable flag of its own (``hosts``)."""

    out: str | None = setting(None, "directory for ca.pem, ca.key and each host's HOST.pem and HOST.key (made 0700; an "
                           "existing CA there signs the new certificates)", metavar="DIR")
    days: int = setting(365, f"validity of each host's certificate, days (1-{MAX_DAYS})")
    ca_days: int = setting(3650, f"validity of a new CA, days (1-{MAX_CA_DAYS})")
    force: bool = setting(False, "overwrite a host's existing certificate and key (the CA is never overwritten: "
                                 "a new CA needs a new --out)")
    hosts: tuple[str, ...] = field(default=(), metadata={"cli": False})

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out DIR is required: the directory to write the certificates to")
        if not self.hosts:
            raise ValueError("give at least one --host IP|NAME[,IP|NAME...]: the hosts the deployment runs on")
        if len(self.hosts) > MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} --host flags, got {len(self.hosts)}")
        if not 1 <= self.days <= MAX_DAYS:
            raise ValueError(f"--days must be 1-{MAX_DAYS}, got {self.days}")
        if not 1 <= self.ca_days <= MAX_CA_DAYS:
            raise ValueError(f"--ca-days must be 1-{MAX_CA_DAYS}, got {self.ca_days}")
        stems = [parse_host(h).stem for h in self.hosts]
        twice = next((s for s in stems if stems.count(s) > 1 or s == "ca"), None)
        if twice is not None:
            raise ValueError(f"--host: two hosts would share the files {twice}.pem/.key (or the CA's): "
                             f"list each host once, its first name unique")


# ---- certificates -------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(cn: str, days: int, now: datetime.datetime | None = None
           ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA (EC P-256) that signs end-entity certificates only."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def new_leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, host: HostNames, days: int,
             now: datetime.datetime | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A host's certificate (EC P-256): SANs its IPs and DNS names, usable as server and client."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([*(x509.IPAddress(ip) for ip in host.ips), *(x509.DNSName(d) for d in host.dns)])
    cert = (x509.CertificateBuilder().subject_name(_name(host.first)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_agreement=False,
                                         content_commitment=False, data_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(san, critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


# ---- files --------------------------------------------------------------------------------------
def _private_dir(out: Path) -> None:
    """out, made 0700; an existing one must be a directory of ours (not a link) no one else may write."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(out, 0o700)
        os.chmod(out, 0o700)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--out {out}: not a directory (a link or a file)")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ValueError(f"--out {out}: must be a directory of this user that others cannot write "
                         f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")


def write_private(path: Path, data: bytes) -> None:
    """data at path, mode 0600, through a temporary file in the same directory and a rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_ca(out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    try:
        cert = x509.load_pem_x509_certificate(read_checked(out / "ca.pem", "CA certificate", MAX_PEM_BYTES))
        key = serialization.load_pem_private_key(read_checked(out / "ca.key", "CA key", MAX_PEM_BYTES, private=True), password=None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the CA in {out} cannot be used: {str(exc)[:300]}") from None
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca or not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ValueError(f"{out}/ca.pem and ca.key are not a CA certificate and its EC key")
    return key, cert


@dataclass(slots=True)
class CertsResult:
    ca_made: bool
    ca: Path
    hosts: dict[str, tuple[Path, Path]] = field(default_factory=dict)   # stem -> (cert, key)

    def describe(self) -> str:
        lines = [f"{'made' if self.ca_made else 'reused'} the deployment CA {self.ca} (key beside it: keep "
                 f"{self.ca.with_suffix('.key').name} off the hosts)"]
        lines += [f"{stem}: --tls-cert {cert} --tls-key {key} --tls-ca {self.ca}"
                  for stem, (cert, key) in self.hosts.items()]
        return "\n".join(lines)


def make_certs(config: CertsConfig, now: datetime.datetime | None = None) -> CertsResult:
    """Write the CA (unless one is there) and each host's certificate and key (see the module)."""
    out = Path(config.out)
    hosts = [parse_host(h) for h in config.hosts]
    _private_dir(out)
    present = [name for name in CA_FILES if os.path.lexists(out / name)]
    if len(present) == 1:
        raise ValueError(f"{out} has {present[0]} but not the other of ca.pem and ca.key: restore it, or use a "
                         f"new --out for a new CA")
    if not config.force:
        taken = [f"{h.stem}{ext}" for h in hosts for ext in (".pem", ".key") if os.path.lexists(out / f"{h.stem}{ext}")]
        if taken:
            raise ValueError(f"{out / taken[0]} exists: pass --force to replace the host's certificate and key")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if present:
        ca_key, ca_cert = _load_ca(out)
        if ca_cert.not_valid_after_utc < now + datetime.timedelta(days=config.days):
            raise ValueError(f"the CA in {out} expires {ca_cert.not_valid_after_utc:%Y-%m-%d}, before certificates "
                             f"of --days {config.days} would: give fewer --days, or make a new CA in a new --out")
    else:
        ca_key, ca_cert = new_ca("pdserve deployment CA", config.ca_days, now)
        write_private(out / "ca.key", pem_key(ca_key))
        write_private(out / "ca.pem", pem_cert(ca_cert))
    result = CertsResult(not present, out / "ca.pem")
    for host in hosts:
        key, cert = new_leaf(ca_key, ca_cert, host, config.days, now)
        write_private(out / f"{host.stem}.key", pem_key(key))
        write_private(out / f"{host.stem}.pem", pem_cert(cert))
        result.hosts[host.stem] = (out / f"{host.stem}.pem", out / f"{host.stem}.key")
    return result
