"""The committed stubs in pdserve/v1 must match a fresh protoc run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_gen_protos() -> ModuleType:
    path = REPO_ROOT / "scripts" / "gen_protos.py"
    spec = importlib.util.spec_from_file_location("gen_protos", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_are_up_to_date(tmp_path: Path) -> None:
    gen = _load_gen_protos()
    fresh = gen.generate(tmp_path)
    committed = gen.generated_files(REPO_ROOT)
    assert fresh, "protoc produced no files"
    fresh_names = [p.name for p in fresh]
    assert fresh_names == [p.name for p in committed], (
        "generated file set differs; run: python scripts/gen_protos.py"
    )
    stale = [
        p.name for p, q in zip(fresh, committed) if p.read_bytes() != q.read_bytes()
    ]
    tools = importlib.metadata.version("grpcio-tools")
    assert not stale, (
        f"stale stubs {stale} (regenerated with grpcio-tools {tools}; the committed "
        "stubs pin the generator version too); run: python scripts/gen_protos.py"
    )


def test_stubs_import_and_presence() -> None:
    from pdserve.v1 import common_pb2, kv_pb2, kv_pb2_grpc, router_pb2_grpc, worker_pb2_grpc

    params = common_pb2.SamplingParams()
    assert not params.HasField("temperature")
    params.temperature = 0.0
    assert params.HasField("temperature")  # explicit presence even for 0
    frame = kv_pb2.KVFrame(payload=b"x")
    assert frame.WhichOneof("frame") == "payload"
    for mod, name in (
        (kv_pb2_grpc, "KVTransfer"),
        (router_pb2_grpc, "Router"),
        (worker_pb2_grpc, "Worker"),
    ):
        assert hasattr(mod, f"{name}Stub") and hasattr(mod, f"{name}Servicer")
    assert not (REPO_ROOT / "proto" / "__init__.py").exists()
