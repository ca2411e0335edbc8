"""A host on the path between prefill and decode rewrites KV: over namespace hosts, without TLS
(`--insecure-internal-plane`), the decode worker advertises a relay on a fourth host as its KV
address (`--kv-advertise-address`); the relay flips a payload byte of the first stream and reseals
every frame with the key an eavesdropper can compute. The decode worker refuses it (DATA_LOSS: the
MAC is keyed by the cluster token), nothing enters its prefix cache, the request migrates and its
greedy tokens are exact."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.deployment import netns
from tests.conftest import random_prompts
from tests.e2e.hosts import INSECURE_FLAG, MAX_NEW, NO_HOSTS, HostDeployment

pytestmark = NO_HOSTS

RELAY_PORT = 7300
PROMPT = random_prompts(1, 120, 120, seed=29)[0]
RELAY = r"""
# A host on the path between prefill and decode: forwards KVTransfer.PushBlocks (metadata both
# ways, so membership proofs pass through) and rewrites the first stream it carries as an attacker
# who reads the wire can: one payload byte flipped, every frame resealed with the only MAC key it
# can compute (the transfer token's, read off the open frame; not the cluster token). Later
# streams pass untouched. It prints each stream's verdict from the decode worker (one line each).
import asyncio, sys
import grpc
from pdserve.v1 import kv_pb2
from pdserve.services.common.grpc_setup import SERVER_OPTIONS, options
from pdserve.services.kv_transfer import frames
from pdserve.services.kv_transfer.frames import parse_frame
from pdserve.services.kv_transfer.grpc_transport import METHOD, SERVICE

listen, target = sys.argv[1], sys.argv[2]
state = {"streams": 0}

class Rewrite:
    def __init__(self):
        self.mac, self.flipped = None, False
    def __call__(self, raw):
        frame = parse_frame(raw)
        if frame.open is not None and frame.open.request_id:
            self.mac = frames.StreamMac(frames.mac_key(frame.open.transfer_token, None),
                                           frame.open.mac_algorithm)
            return raw   # the open frame as sent: its stream's proof names it (the MACs are what is tested)
        if self.mac is None:
            return raw
        body = bytes(frame.signed)
        if not self.flipped and frame.payload:
            payload = bytearray(frame.payload)
            payload[len(payload) // 2] ^= 0x01
            body = kv_pb2.KVFrame(headers=list(frame.headers), payload=bytes(payload)).SerializeToString()
            self.flipped = True
        return body + kv_pb2.KVFrame(mac=self.mac.seal([body])).SerializeToString()

async def main():
    channel = grpc.aio.insecure_channel(target, options=options())
    forward = channel.stream_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)

    watchers = set()

    async def outcome(n, call):
        # The decode worker's verdict on stream n, printed even when the sender has cancelled
        # its side first (the router migrates the request at once).
        try:
            ack = kv_pb2.PushAck.FromString(await call)
            line = f"{ack.error_code}: {ack.error}" if ack.error_code else "passed"
        except grpc.aio.AioRpcError as exc:
            line = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            line = "cancelled"
        print(f"stream {n}: {line}", flush=True)

    async def push(requests, context):
        state["streams"] += 1
        n = state["streams"]
        rewrite = Rewrite() if n == 1 else (lambda raw: raw)
        call = forward(metadata=context.invocation_metadata())
        watcher = asyncio.ensure_future(outcome(n, call))   # not cancelled with this handler
        watchers.add(watcher)
        watcher.add_done_callback(watchers.discard)

        async def pump():
            try:
                async for raw in requests:
                    await call.write(rewrite(raw))
                await call.done_writing()
            except Exception as exc:
                print(f"stream {n}: relay error {type(exc).__name__}: {exc}", flush=True)
        pumping = asyncio.ensure_future(pump())
        try:
            await context.send_initial_metadata(await call.initial_metadata())
            return await call
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())
        finally:
            pumping.cancel()

    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(push, request_deserializer=lambda b: b,
                                                   response_serializer=lambda b: b)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"PushBlocks": handler}),))
    server.add_insecure_port(listen)
    await server.start()
    print("relay listening", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _wait_line(path, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            pytest.fail(f"no {line!r} in {path} after {timeout}s:\n{path.read_text(errors='replace')}")
        time.sleep(0.1)


def test_a_block_rewritten_between_hosts_fails_closed_and_the_request_recovers(tiny_qwen3, tmp_path) -> None:
    want = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0].token_ids
    with netns.HostNetwork(4) as net:
        d = HostDeployment(tiny_qwen3, net, tmp_path, {r: [INSECURE_FLAG] for r in ("prefill", "decode", "router")})
        relay_at = f"{net[3].address}:{RELAY_PORT}"
        decode = d.worker(net[2], "decode", "--kv-advertise-address", relay_at)
        relay_log = tmp_path / "relay.log"
        with open(relay_log, "ab") as log:
            net[3].popen([sys.executable, "-c", RELAY, relay_at, decode], env=d.env, stdout=log,
                         stderr=subprocess.STDOUT)
        _wait_line(relay_log, "relay listening", 60)
        d.start_router(net[0], [d.worker(net[1], "prefill")], [decode])
        first = d.drive([PROMPT], metrics=("pdserve:prefix_cache_hits_total", "pdserve:kv_transfer_failures_total"))
        again = d.drive([PROMPT], metrics=("pdserve:prefix_cache_hits_total",))
        _wait_line(relay_log, "stream 1: ", 30)
        relayed = relay_log.read_text(errors="replace")
        decode_log = (tmp_path / "decode-0.log").read_text(errors="replace")
    assert first["tokens"] == [want] and again["tokens"] == [want]
    assert first["timings"][0]["migrations"] == 1, first["timings"]
    # the decode worker refused the rewritten stream for its MAC (the relay may see only the
    # sender's cancel: the router migrates the request as soon as the decode call fails)
    assert "refused: DATA_LOSS" in decode_log and "fails its MAC" in decode_log, decode_log[-3000:]
    assert "stream 1: " in relayed and "stream 2: passed" in relayed, relayed
    decode_metrics = first["metrics"][0]   # workers in start order: decode, prefill
    assert decode_metrics["pdserve:kv_transfer_failures_total"] >= 1, first["metrics"]
    # nothing of the refused stream was cached: the retry found no block of the prompt; the same
    # prompt again finds the retry's blocks (the counter does count reservations' lookups)
    assert decode_metrics["pdserve:prefix_cache_hits_total"] == 0, first["metrics"]
    assert again["metrics"][0]["pdserve:prefix_cache_hits_total"] > 0, again["metrics"]
    assert all(free == total for _, free, total in first["blocks"] + again["blocks"])
