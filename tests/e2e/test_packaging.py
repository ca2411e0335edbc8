"""One import name: the wheel installs `pdserve` (engine/ and services/ as pdserve.engine and
pdserve.services) and its console script, nothing else at the top of site-packages, so an
application with its own top-level `services` package imports pdserve's client beside it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ("LLM", "SamplingParams", "Client", "AsyncClient")


def test_the_package_list_is_the_source_tree() -> None:
    """pyproject's explicit package list (package-dir maps engine/ and services/ under pdserve)
    names every folder that holds an __init__.py, and only those."""
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+; the wheel test below runs everywhere
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"pdserve": "pdserve", "pdserve.engine": "engine", "pdserve.services": "services"}
    tree = {"pdserve." + ".".join(init.parent.relative_to(ROOT).parts)
            for top in ("engine", "services") for init in (ROOT / top).rglob("__init__.py")}
    tree |= {"pdserve", "pdserve.v1"}
    assert set(tool["packages"]) == tree


def test_the_wheel_installs_one_import_name_beside_an_application_s_own_services(tmp_path: Path) -> None:
    # Built from a copy of the sources: setuptools builds in the tree, and a build/ left there by an
    # earlier build would carry modules since removed into this wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("engine", "services", "pdserve"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert tops == {"pdserve", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth", "__pycache__"))
                  and not p.name.startswith("_")) == ["pdserve"]
    # The dependencies come from this test's own environment, as a plain path (its .pth files, the
    # editable install's finder among them, are not run): pdserve itself only from the wheel.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    app = tmp_path / "app"
    (app / "services").mkdir(parents=True)
    (app / "services" / "__init__.py").write_text('WHOSE = "the application"\n')
    code = ("import services, pdserve\n"
            "from pdserve import " + ", ".join(PUBLIC) + "\n"
            "import pdserve.engine, pdserve.services.client\n"
            "assert services.WHOSE == 'the application', services.__file__\n"
            "print(pdserve.__file__, pdserve.engine.__file__, pdserve.services.client.__file__, services.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    res = subprocess.run([str(python), "-c", code], cwd=app, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    where = res.stdout.split()
    assert all(path.startswith(str(site)) for path in where[:3]), where
    assert where[3].startswith(str(app)), where
    version = subprocess.run([str(venv / "bin" / "pdserve"), "--version"], cwd=app, env=env, capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("pdserve "), version.stderr[-2000:]
