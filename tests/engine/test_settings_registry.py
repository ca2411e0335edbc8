"""engine.settings: every environment variable engine/ and services/ read is declared once in the
ENV registry, and read through it (this file also runs as a script)."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from pdserve.engine.settings import ENV, EnvVar, pdserve_home

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "engine" / "settings.py"


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def direct_env_uses(path: Path, root: Path = ROOT) -> list[str]:
    """`os.getenv(...)`, `os.environ[...]`, `os.environ.get/pop/setdefault(...)`, `... in os.environ`:
    reads and writes that bypass the registry. Copying the whole environment for a child process
    (`{**os.environ, ...}`, `dict(os.environ)`) is allowed: it names no variable."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        bad = None
        if isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            bad = "os.getenv"
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            bad = "os.environ[...]"
        elif isinstance(node, ast.Attribute) and _is_environ(node.value):
            bad = f"os.environ.{node.attr}"
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            bad = "in os.environ"
        if bad:
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {bad}"))
    return [text for _, text in sorted(found)]


def test_every_environment_read_goes_through_the_registry():
    files = [p for d in ("engine", "services") for p in sorted((ROOT / d).rglob("*.py"))
             if p != REGISTRY and "_pb2" not in p.name]
    uses = [u for p in files for u in direct_env_uses(p)]
    assert not uses, "read these through engine.settings.ENV:\n" + "\n".join(uses)


def test_the_checker_sees_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\na = os.getenv('X')\nb = os.environ['X']\nc = os.environ.get('X')\n"
                   "d = 'X' in os.environ\nos.environ['X'] = '1'\nchild = {**os.environ, 'Y': '1'}\n")
    uses = direct_env_uses(src, tmp_path)
    assert [u.split(": ")[1] for u in uses] == ["os.getenv", "os.environ[...]", "os.environ.get", "in os.environ",
                                                 "os.environ[...]"]


def test_names_are_unique_and_documented():
    names = [v.name for v in ENV.all()]
    assert len(names) == len(set(names))
    assert all(v.help for v in ENV.all())
    assert ENV.named("PDSERVE_HOME") is ENV.HOME
    with pytest.raises(KeyError, match="not declared"):
        ENV.named("PDSERVE_NO_SUCH_THING")


def test_pdserve_help_lists_the_user_facing_variables():
    from pdserve.services.cli.commands import build_parser
    epilog = build_parser(None).epilog
    for var in ENV.all():
        assert (f"{var.name}: {var.help}" in epilog) == (not var.internal), var.name


def test_typed_reads(monkeypatch):
    monkeypatch.delenv("PDSERVE_RESERVED_PORTS", raising=False)
    assert ENV.RESERVED_PORTS.get() == ()
    monkeypatch.setenv("PDSERVE_RESERVED_PORTS", "5001,5002")
    assert ENV.RESERVED_PORTS.get() == (5001, 5002)
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    assert ENV.CPU_KERNELS.get() is False
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", " ")   # blank: the default
    assert ENV.CPU_KERNELS.get() is True
    monkeypatch.setenv("PDSERVE_PARENT_PID", "abc")
    with pytest.raises(ValueError, match=r"\$PDSERVE_PARENT_PID"):
        ENV.PARENT_PID.get()
    monkeypatch.setenv("PDSERVE_HOME", "~/x")
    assert pdserve_home() == Path.home() / "x"
    monkeypatch.delenv("PDSERVE_HOME")
    assert pdserve_home() == Path.home() / ".cache" / "pdserve"
    var = EnvVar("PDSERVE_TEST_VAR", 3, "a test", parse=int)
    assert var.env(4) == {"PDSERVE_TEST_VAR": "4"}


def test_settings_imports_nothing_heavy():
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import sys, pdserve.engine.settings; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ})
    assert out.stdout.strip() == "False"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
