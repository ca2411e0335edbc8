"""API keys and what they grant (services/api/principals.py): the keys file is checked before it
is read, a key maps to its principal, a priority past the grant is refused naming the limit."""
from __future__ import annotations

import os
import threading

import pytest

from pdserve.services.api.principals import ApiKeys, Principal, bound_to
from pdserve.services.router.slo import ServiceClass

KEY = "k" * 20


def _keys_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_key_names_its_principal_and_grant(tmp_path) -> None:
    keys = ApiKeys.load(_keys_file(tmp_path, f"# comment\nalice {KEY}\nops {'o' * 20} min_priority=-5  # admins\n"),
                        min_client_priority=0, single_key="s" * 20)
    assert keys.identify(f"Bearer {KEY}") == Principal("alice", 0)
    assert keys.identify("bearer " + "o" * 20) == Principal("ops", -5)
    assert keys.identify("Bearer " + "s" * 20) == Principal("default", 0)
    for wrong in (None, "", "Bearer", f"Basic {KEY}", f"Bearer {KEY}x", KEY):
        assert keys.identify(wrong) is None
    assert ApiKeys().identify(None) == Principal("", 0)   # an open API: the anonymous caller


def test_a_priority_past_the_grant_is_refused_naming_the_field_and_limit() -> None:
    alice = Principal("alice", 0)
    assert bound_to(ServiceClass(priority=3, client="u"), alice) == ServiceClass(3, "u", principal="alice")
    with pytest.raises(ValueError, match=r"priority must be >= 0 for API key 'alice'.*got -1000"):
        bound_to(ServiceClass(priority=-1000), alice)
    assert bound_to(ServiceClass(priority=-7), Principal("ops", -10)).priority == -7


@pytest.mark.parametrize("text, message", [
    ("alice short\n", "at least 16"), ("al/ce " + KEY + "\n", "NAME KEY"), (f"a {KEY} prio=1\n", "min_priority=N"),
    (f"a {KEY} min_priority=x\n", "min_priority=N"), (f"a {KEY}\na {'z' * 20}\n", "already given"),
    ("# nothing\n", "holds no key"), (f"a {KEY} min_priority={2**31}\n", "min_priority=N")])
def test_a_malformed_keys_file_is_refused_naming_the_line(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ApiKeys.load(_keys_file(tmp_path, text))


def test_an_unsafe_keys_file_is_refused_before_it_is_read(tmp_path) -> None:
    with pytest.raises(ValueError, match="group or others"):
        ApiKeys.load(_keys_file(tmp_path, f"a {KEY}\n", mode=0o644))
    target = _keys_file(tmp_path, f"a {KEY}\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="a symbolic link is refused"):
        ApiKeys.load(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, ApiKeys.load, fifo)), daemon=True)
    t.start()
    t.join(5)
    assert done and "not a regular file" in str(done[0].value)   # refused at once, never blocked
    os.chown(target, 12345, 12345)
    with pytest.raises(ValueError, match="owned by uid 12345"):
        ApiKeys.load(target)
