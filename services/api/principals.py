"""Who a client is, and what its credential lets it ask for.

The router's public API knows its callers by their API key. Each key names a principal: the
fair-share key of the admission queue (a client cannot split itself into many `user`s to take
more than its share), the scope of its request ids (another key's holder cannot abort or squat
them), and its grants: the most urgent priority it may ask for (``min_priority``; lower values
first, as vLLM's ``priority``). A key without a grant gets the deployment's floor,
``--min-client-priority`` (default 0: clients may only lower their own priority).

Keys come from ``--api-key`` / ``--api-key-file`` / ``$PDSERVE_API_KEY`` (one key, principal
``default``) or from ``--api-keys-file``, one key a line::

    # NAME  KEY                      [min_priority=N]
    batch   0c8f...(16+ characters)
    chat    9a1e...                  min_priority=-10

That file holds secrets: it must be a regular file (not a symlink) owned by this user or root,
readable by nobody else, at most ``MAX_KEYS_FILE_BYTES``. Without any key the API is open and
every caller is the one anonymous principal ``""`` (with the deployment's floor).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Callable

import grpc

from pdserve.engine.sampling_params import PRIORITY_RANGE
from pdserve.services.common.proof_interceptors import OPEN_METHOD_PREFIXES, refusing
from pdserve.services.common.checked_files import read_checked
from pdserve.services.common.proofs import API_KEY_HEADER
from pdserve.services.router.slo import ServiceClass

MAX_KEYS_FILE_BYTES = 1 << 20
MIN_KEY_CHARS = 16
DEFAULT_PRINCIPAL = "default"
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller (``name`` "": the open API's anonymous one) and its grant."""

    name: str = ""
    min_priority: int = 0   # the most urgent priority this caller may ask for

    def check_priority(self, priority: int) -> None:
        """ValueError naming the field and this caller's limit when it asks for more urgency."""
        if priority < self.min_priority:
            whose = f"API key {self.name!r}" if self.name else "an unauthenticated client"
            raise ValueError(f"priority must be >= {self.min_priority} for {whose} (lower values are served first; "
                             f"a key granted min_priority may go lower), got {priority}")


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeys:
    """The router's API keys. ``identify`` maps a presented bearer key to its principal by the
    key's SHA-256 (the lookup leaks nothing about a key a caller does not already hold)."""

    def __init__(self, principals: dict[str, Principal] | None = None, min_client_priority: int = 0) -> None:
        if not PRIORITY_RANGE[0] <= min_client_priority <= PRIORITY_RANGE[1]:
            raise ValueError(f"min_client_priority must be in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], "
                             f"got {min_client_priority}")
        self._by_digest = {_digest(key): p for key, p in (principals or {}).items()}
        self.anonymous = Principal("", min_client_priority)

    @property
    def required(self) -> bool:
        return bool(self._by_digest)

    @classmethod
    def of(cls, keys: "ApiKeys | str | None", min_client_priority: int = 0) -> "ApiKeys":
        """keys as given to the servers: an ApiKeys, one key (principal ``default``), or none."""
        if isinstance(keys, ApiKeys):
            return keys
        return cls({keys: Principal(DEFAULT_PRINCIPAL, min_client_priority)} if keys else None, min_client_priority)

    def identify(self, authorization: str | bytes | None) -> Principal | None:
        """The principal of an ``Authorization: Bearer KEY`` value; None when keys are required and
        this is none of them. Without keys: the anonymous principal."""
        if not self.required:
            return self.anonymous
        if not authorization:
            return None
        raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
        scheme, _, key = raw.partition(b" ")
        if scheme.lower() != b"bearer" or not key:
            return None
        return self._by_digest.get(_digest(key.strip()))

    def interceptor(self, exempt: tuple[str, ...] = ()) -> "ApiKeyInterceptor":
        """The gRPC check: a call without one of these keys is refused before any work (health
        checks and the exempt method prefixes, which another check guards, pass)."""
        return ApiKeyInterceptor(self, exempt)

    @classmethod
    def load(cls, path: str | os.PathLike, min_client_priority: int = 0, single_key: str | None = None) -> "ApiKeys":
        """The keys of an --api-keys-file (and one more key, principal ``default``, if given).
        ValueError naming the file and line when it is unsafe or malformed."""
        try:
            text = read_checked(path, "API keys file", MAX_KEYS_FILE_BYTES, private=True).decode()
        except UnicodeDecodeError:
            raise ValueError(f"API keys file {path} is not UTF-8 text") from None
        principals: dict[str, Principal] = {}
        if single_key:
            principals[single_key] = Principal(DEFAULT_PRINCIPAL, min_client_priority)
        names = {p.name for p in principals.values()}
        for n, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"API keys file {path}, line {n}"
            if len(words) not in (2, 3) or not _NAME.fullmatch(words[0]):
                raise ValueError(f"{where}: expected NAME KEY [min_priority=N] (NAME: 1-64 of A-Z a-z 0-9 _ . @ -)")
            name, key = words[0], words[1]
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"{where}: the key of {name!r} must have at least {MIN_KEY_CHARS} characters")
            grant = min_client_priority
            if len(words) == 3:
                option, _, value = words[2].partition("=")
                try:
                    grant = int(value)
                except ValueError:
                    grant = None
                if option != "min_priority" or grant is None or not PRIORITY_RANGE[0] <= grant <= PRIORITY_RANGE[1]:
                    raise ValueError(f"{where}: the third word must be min_priority=N with N in "
                                     f"[{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
            if name in names or key in principals:
                raise ValueError(f"{where}: {name!r} or its key is already given")
            names.add(name)
            principals[key] = Principal(name, grant)
        if not principals:
            raise ValueError(f"API keys file {path} holds no key")
        return cls(principals, min_client_priority)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, exempt: tuple[str, ...] = ()) -> None:
        self.keys = keys
        self.open = (*OPEN_METHOD_PREFIXES, *exempt)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        if details.method.startswith(self.open):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == API_KEY_HEADER), None)
        handler = await continuation(details)
        if self.keys.identify(given) is not None:
            return handler
        return refusing(handler, "missing or wrong API key")


def bound_to(service: ServiceClass, principal: Principal) -> ServiceClass:
    """The request's class as its caller may have it: its priority within the caller's grant
    (ValueError naming the field and the limit otherwise), its fair share and scope the caller's."""
    principal.check_priority(service.priority)
    return dataclasses.replace(service, principal=principal.name)
