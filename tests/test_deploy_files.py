"""The compose file's commands are valid pdserve invocations and keep ports on loopback."""
from __future__ import annotations

from pathlib import Path

import yaml

from services.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_compose_commands_parse_with_the_cli() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parser = build_parser()
    services = compose["services"]
    assert {"router", "prefill", "decode"} <= set(services)
    for name, svc in services.items():
        args = parser.parse_args(svc["command"])
        assert args.command in ("make-model", "router", "prefill", "decode"), name
        if "healthcheck" in svc:
            test = svc["healthcheck"]["test"]
            assert parser.parse_args(test[2:]).command == "health"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    router = parser.parse_args(services["router"]["command"])
    assert router.prefill == "prefill:50052" and router.decode == "decode:50053"
