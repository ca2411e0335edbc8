"""The KV hand-off's integrity check: a MAC over every frame, keyed per reservation.

Key: ``HMAC-SHA256(cluster_token, MAC_CONTEXT + transfer_token)``. The cluster token never
travels (only HMAC proofs of it do), so an on-path host that reads the transfer token off the
wire still cannot compute the key, and a block rewritten on the path (bytes and header CRC
together) fails closed with DATA_LOSS. Without a cluster token (``--insecure-no-auth``,
loopback only) the key is ``HMAC-SHA256(MAC_CONTEXT, transfer_token)``: anyone who reads the
stream can compute it, so it protects against accidents (corruption, a misrouted stream), not
against an attacker.

One MAC per send window rather than per block: over gRPC, a frame's MAC covers a counter (the
frame's position on its stream, so frames cannot be dropped, replayed or reordered), the
frame's bytes before its ``mac`` field (headers and payload, or the shared-memory field), and,
for a shared-memory frame, the segment's bytes (what the receiver reads). Over Ray, one MAC per
``push_blocks`` call covers its headers and payloads (a replayed block is refused by the
connector as already received).

Algorithms. HMAC-SHA256 always works (and keys everything). Where the ``cryptography`` package
is installed, streams use AES-256-GMAC (AES-GCM over no plaintext, the frame as associated
data) keyed with HMAC-SHA256(key, "aes-gmac"), the frame's index its 96-bit nonce; and they still
take Poly1305, whose one-time key per frame is HMAC-SHA256(key, "poly1305" + its index). Either
way no (key, nonce) pair is ever used for two messages: one key per reservation, one stream per
reservation, one index per frame. Measured over 1 MiB frames (8 parts) on a 2-core AMD EPYC
Zen 4 (AVX-512, VAES, VPCLMULQDQ): GMAC 62 us, Poly1305 120 us (HMAC-SHA256 about 1.8 GB/s,
keyed BLAKE2b 1 GB/s, CRC-32 3.4-6 GB/s). The open frame names the algorithm (and is MACed with
it); a receiver without it refuses with FAILED_PRECONDITION.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

from pdserve.engine.kv.handoff import HandoffError

try:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms as ciphers, modes as cipher_modes
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:      # an optional speed-up: HMAC-SHA256 instead
    Cipher = Poly1305 = None

MAC_CONTEXT = b"pdserve-kv-mac-v1"
HMAC_SHA256, POLY1305, AES_GMAC = "hmac-sha256", "poly1305", "aes-gmac"
ALGORITHMS = (HMAC_SHA256, POLY1305, AES_GMAC) if Poly1305 is not None else (HMAC_SHA256,)
PREFERRED = ALGORITHMS[-1]


def mac_key(transfer_token: bytes, cluster_token: str | bytes | None) -> bytes:
    """The reservation's MAC key (see the module docstring)."""
    if cluster_token:
        secret = cluster_token.encode() if isinstance(cluster_token, str) else cluster_token
        return hmac.new(secret, MAC_CONTEXT + transfer_token, hashlib.sha256).digest()
    return hmac.new(MAC_CONTEXT, transfer_token, hashlib.sha256).digest()


def compute(key: bytes, parts: Iterable[bytes | bytearray | memoryview], counter: int | None = None) -> bytes:
    """The MAC of parts concatenated (no copy), after the 8-byte counter when there is one."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    if counter is not None:
        h.update(counter.to_bytes(8, "little"))
    for part in parts:
        h.update(part)
    return h.digest()


def _poly1305(key: bytes, parts: Iterable[bytes | bytearray | memoryview], counter: int) -> bytes:
    mac = Poly1305(hmac.new(key, b"poly1305" + counter.to_bytes(8, "little"), hashlib.sha256).digest())
    for part in parts:
        mac.update(part)
    return mac.finalize()


def _gmac(key: bytes, parts: Iterable[bytes | bytearray | memoryview], counter: int) -> bytes:
    """key: the stream's AES key (derived once: StreamMac)."""
    tag = Cipher(ciphers.AES(key), cipher_modes.GCM(counter.to_bytes(12, "little"))).encryptor()
    for part in parts:
        tag.authenticate_additional_data(part)
    tag.finalize()
    return tag.tag


def algorithm(name: str) -> str:
    """The algorithm an open frame names ("" is HMAC-SHA256); FAILED_PRECONDITION if unavailable."""
    name = name or HMAC_SHA256
    if name not in ALGORITHMS:
        raise HandoffError("FAILED_PRECONDITION", f"KV frames MACed with {name!r}, which this worker cannot check "
                                                  f"(it has {', '.join(ALGORITHMS)}; poly1305 needs the "
                                                  f"'cryptography' package)")
    return name


class StreamMac:
    """One stream's MACs, in frame order: the sender seals, the receiver verifies."""

    def __init__(self, key: bytes, name: str = HMAC_SHA256) -> None:
        self.key = key
        self.name = algorithm(name)
        self.counter = 0
        self._aes_key = hmac.new(key, b"aes-gmac", hashlib.sha256).digest() if self.name == AES_GMAC else b""

    def _tag(self, parts: Iterable[bytes | bytearray | memoryview]) -> bytes:
        if self.name == AES_GMAC:
            return _gmac(self._aes_key, parts, self.counter)
        if self.name == POLY1305:
            return _poly1305(self.key, parts, self.counter)
        return compute(self.key, parts, self.counter)

    def seal(self, parts: Iterable[bytes | bytearray | memoryview]) -> bytes:
        mac = self._tag(parts)
        self.counter += 1
        return mac

    def verify(self, parts: Iterable[bytes | bytearray | memoryview], mac: bytes, what: str) -> None:
        """Raises DATA_LOSS unless mac is this frame's MAC."""
        expected = self._tag(parts)
        self.counter += 1
        if not mac:
            raise HandoffError("DATA_LOSS", f"{what}: frame {self.counter - 1} carries no MAC")
        if not hmac.compare_digest(expected, bytes(mac)):
            raise HandoffError("DATA_LOSS", f"{what}: frame {self.counter - 1} fails its MAC (rewritten on the path, "
                                            f"or keyed by another deployment's cluster token)")


def verify_once(key: bytes, parts: Iterable[bytes | bytearray | memoryview], mac: bytes, what: str) -> None:
    """An uncounted MAC (a Ray push_blocks call): right, or DATA_LOSS."""
    if not mac or not hmac.compare_digest(compute(key, parts), bytes(mac)):
        raise HandoffError("DATA_LOSS", f"{what}: a push_blocks call fails its MAC (or carries none)")
