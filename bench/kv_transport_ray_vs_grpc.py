#!/usr/bin/env python
"""KV transfer throughput: Ray object store vs. gRPC, same blocks, same run.

Two Ray actors play prefill and decode. The prefill actor builds the blocks once
(deterministic random data, shaped like a model's KV block) and pushes them,
alternating transports each iteration:

  * ray:  RayKVSender -> ray.put per block + decode actor's push_blocks(headers, refs)
          -> RayKVReceiver (resolve refs, header/length/CRC-32 checks) -> sink
  * grpc: GrpcKVSender -> KVTransfer.PushBlocks served by a grpc.aio server in the
          decode actor (frames, reassembly, the same checks) -> sink

Both receivers hand verified blocks to the same sink, which copies each block into
a preallocated pool (like the decode worker's write into its paged cache; ``--sink
discard`` skips the copy). Reported: MiB/s of block payload (median over
iterations of one push of ``--blocks`` blocks), and the ratio ray/grpc.

By default it starts its own loopback-only local cluster (token auth, no
dashboard); ``--address`` uses a running one (both actors are then placed with
``--spread`` on different nodes if asked, to measure a cross-node pull). Example::

    /work/venv/bin/python bench/kv_transport_ray_vs_grpc.py --blocks 32 --iters 7
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20


class SinkActor:
    """Decode side: push_blocks (object store) and a gRPC KVTransfer server, one sink."""

    async def __init__(self, pool_blocks: int, nbytes: int, copy: bool) -> None:
        import grpc
        import torch

        from services.kv_transfer import add_kv_transfer_servicer, decode_tensor, kv_grpc_options
        from services.kv_transfer.ray_transport import RayKVReceiver

        pool = torch.empty((pool_blocks, nbytes), dtype=torch.uint8)

        class PoolSink:
            def __init__(self) -> None:
                self.n = 0

            def accept_block(self, header, payload) -> None:
                if copy:
                    pool[self.n % pool_blocks].copy_(decode_tensor(header, payload).reshape(-1).view(torch.uint8))
                self.n += 1

        self.sink = PoolSink()
        self.receiver = RayKVReceiver(self.sink, max_block_bytes=1 << 30)
        self.server = grpc.aio.server(options=kv_grpc_options())
        add_kv_transfer_servicer(self.server, self.sink, max_block_bytes=1 << 30)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.grpc_address = f"127.0.0.1:{port}"

    async def address(self) -> str:
        return self.grpc_address

    async def push_blocks(self, headers, refs) -> bytes:
        return await self.receiver.push_blocks(headers, refs)

    async def node(self) -> str:
        import ray
        return ray.util.get_node_ip_address()


class SourceActor:
    """Prefill side: the blocks, and one sender per transport."""

    async def __init__(self, shape: list[int], dtype: str, blocks: int, namespace: str, chunk_bytes: int) -> None:
        import torch

        from services.kv_transfer import GrpcKVSender, KVBlock, dtype_from_name
        from services.kv_transfer.ray_transport import RayKVSender

        gen = torch.Generator().manual_seed(0)
        data = torch.randn((blocks, *shape), generator=gen, dtype=torch.float32).to(dtype_from_name(dtype))
        self.blocks = [KVBlock.from_tensor(data[i], request_id="bench", block_index=i, block_hash=i,
                                           num_tokens=shape[2] if len(shape) > 2 else 1, layer_start=0,
                                           layer_end=shape[0]) for i in range(blocks)]
        self.nbytes = data[0].numel() * data.element_size()
        self.senders = {"ray": RayKVSender(default_namespace=namespace, chunk_bytes=chunk_bytes),
                        "grpc": GrpcKVSender()}

    async def block_bytes(self) -> int:
        return self.nbytes

    async def push(self, transport: str, target: str) -> float:
        t0 = time.perf_counter()
        result = await self.senders[transport].send_blocks(target, self.blocks)
        seconds = time.perf_counter() - t0
        if result.rejected or result.blocks != len(self.blocks):
            raise RuntimeError(f"{transport}: {result}")
        return seconds

    async def node(self) -> str:
        import ray
        return ray.util.get_node_ip_address()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="local", help="Ray cluster address, or local (start a loopback head)")
    p.add_argument("--block-shape", default="28,2,16,8,128",
                   help="layers,K/V,block_size,kv_heads,head_dim (default: a 7B-class GQA model, 16-token blocks)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--blocks", type=int, default=32, help="blocks per push (one request's worth)")
    p.add_argument("--iters", type=int, default=7, help="timed pushes per transport (after one warm-up each)")
    p.add_argument("--sink", choices=["copy", "discard"], default="copy")
    p.add_argument("--ray-chunk-mib", type=float, default=32.0,
                   help="RayKVSender chunk: one object and one push_blocks call per chunk (pipelined)")
    p.add_argument("--object-store-mb", type=int, default=1024, help="local cluster's object store")
    p.add_argument("--spread", action="store_true", help="place sender and receiver on different nodes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    shape = [int(x) for x in args.block_shape.split(",")]
    from services.ray_deploy.cluster import start_local_cluster, stop_local_cluster, use_loopback_node

    local = None
    if args.address == "local":
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
            import secrets
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)   # throwaway cluster, throwaway token
        use_loopback_node()
        local = start_local_cluster(num_cpus=2, object_store_bytes=args.object_store_mb * MiB, save=False)
        address = local.address
    else:
        address = args.address
    import ray

    namespace = "pdserve-bench"
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
        # The actor classes by module name (not __main__), so that Ray ships a reference, not pickled code.
        from bench import kv_transport_ray_vs_grpc as this

        opts = {"num_cpus": 0, **({"scheduling_strategy": "SPREAD"} if args.spread else {})}
        source = ray.remote(this.SourceActor).options(**opts).remote(shape, args.dtype, args.blocks, namespace,
                                                                   int(args.ray_chunk_mib * MiB))
        block_bytes = ray.get(source.block_bytes.remote())
        sink = ray.remote(this.SinkActor).options(name="bench-sink", **opts).remote(
            args.blocks, block_bytes, args.sink == "copy")
        grpc_addr = ray.get(sink.address.remote())
        targets = {"ray": f"ray://{namespace}/bench-sink", "grpc": grpc_addr}
        nodes = ray.get([source.node.remote(), sink.node.remote()])
        times: dict[str, list[float]] = {"ray": [], "grpc": []}
        for t in targets:   # warm-up: channels, actor handles, first allocations
            ray.get(source.push.remote(t, targets[t]))
        for _ in range(args.iters):
            for t in targets:
                times[t].append(ray.get(source.push.remote(t, targets[t])))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if local is not None:
            stop_local_cluster(local)

    push_mib = args.blocks * block_bytes / MiB
    rows = {}
    for t, ts in times.items():
        med = statistics.median(ts)
        rows[t] = {"mib_per_s": push_mib / med, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                   "max_ms": max(ts) * 1e3}
    ratio = rows["ray"]["mib_per_s"] / rows["grpc"]["mib_per_s"]
    if args.json:
        print(json.dumps({"block_shape": shape, "dtype": args.dtype, "block_bytes": block_bytes,
                          "blocks": args.blocks, "iters": args.iters, "sink": args.sink, "nodes": nodes,
                          "ray_chunk_mib": args.ray_chunk_mib,
                          "results": rows, "ray_over_grpc": ratio}))
        return 0
    print(f"KV blocks {args.dtype}{shape} = {block_bytes / MiB:.2f} MiB each, {args.blocks} per push "
          f"({push_mib:.1f} MiB), {args.iters} pushes per transport, sink={args.sink}, ray chunk {args.ray_chunk_mib} MiB, "
          f"sender on {nodes[0]}, receiver on {nodes[1]}")
    print(f"{'transport':<10} {'MiB/s':>9} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for t, r in rows.items():
        print(f"{t:<10} {r['mib_per_s']:>9.0f} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f} {r['max_ms']:>8.1f}")
    print(f"ray / grpc throughput: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
