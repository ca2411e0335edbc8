"""The committed stubs in pdserve/v1 must match a fresh protoc run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[3]


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
    for mod, name in (
        (kv_pb2_grpc, "KVTransfer"),
        (router_pb2_grpc, "Router"),
        (worker_pb2_grpc, "Worker"),
        (worker_pb2_grpc, "PrefillWorker"),
        (worker_pb2_grpc, "DecodeWorker"),
        (worker_pb2_grpc, "ColocatedWorker"),
    ):
        assert hasattr(mod, f"{name}Stub") and hasattr(mod, f"{name}Servicer")
    assert not (REPO_ROOT / "proto" / "__init__.py").exists()
    assert kv_pb2.KVFrame(payload=b"x").payload == b"x"


def test_hand_encoded_kv_frames_are_standard_protobuf() -> None:
    """The transport's hand-written frames parse as KVFrame, and its parser reads what protobuf writes."""
    import torch

    from pdserve.v1 import kv_pb2
    from pdserve.services.kv_transfer import KVBlock
    from pdserve.services.kv_transfer.frames import encode_frames, encode_open, parse_frame

    blocks = [KVBlock("r", i, 100 + i, torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i) for i in range(3)]
    frames = encode_frames(blocks, frame_bytes=150)   # 96-byte blocks: some share a frame, some span two
    assert len(frames) == 2
    payload = b"".join(kv_pb2.KVFrame.FromString(f).payload for f in frames)
    assert payload == b"".join(b.data.numpy().tobytes() for b in blocks)
    headers = [h for f in frames for h in kv_pb2.KVFrame.FromString(f).headers]
    assert [h.block_index for h in headers] == [0, 1, 2] and headers[2].block_hash == 102
    opened = kv_pb2.KVFrame.FromString(encode_open("r", b"token"))
    assert opened.open.request_id == "r" and opened.open.transfer_token == b"token"
    standard = kv_pb2.KVFrame(headers=headers[:1], payload=b"abc").SerializeToString()
    parsed = parse_frame(standard)
    assert not parsed.error and bytes(parsed.payload) == b"abc" and parsed.headers[0].block_index == 0
    assert parse_frame(b"\x1a\xff").error   # truncated: reported, never raised
