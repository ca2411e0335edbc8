#!/usr/bin/env python
"""The KV hand-off across emulated hosts: how much of a link's time for a prompt's KV the
hand-off exposes, at 1 and 10 Gbit/s, next to a raw TCP socket sending the same bytes.

Router, prefill and decode workers run on three hosts (network namespaces joined by a bridge,
services/deployment/netns.py, each host's egress limited by tc tbf), started through the CLI
with one thread each. The client, in the router's host, sends fresh random prompts (no
prefix-cache hits; greedy, a few tokens) one at a time and reads the router's timings:
``kv_transfer_ms`` (the exposed hand-off: from the first token's sampling until the decode
worker has acknowledged every block) and ``ttft_ms``; the KV bytes of each prompt come from the
prefill worker's ``pdserve:kv_transfer_bytes`` counter. The prefill step budget covers the
longest prompt (one chunk), so every block of a prompt is exposed. For the same bytes:

* link: bytes * 8 / rate, the tbf rate's own time;
* socket: a raw TCP connection from the prefill host to the decode host, opened beforehand,
  timed from the first byte sent to a one-byte answer after the last (one send per prompt size).

With ``--pin-hosts`` the prefill host's processes (its worker, the raw socket's sender) run on
CPU 0 and the decode host's (its worker, the raw socket's receiver) on CPU 1, as if each host
had a core of its own; the router's host (router, client) takes either. Without it every
process takes any core.

Ratios printed: exposed hand-off / link, exposed hand-off / socket. Where ``pdserve prefill
--help`` lists ``--kv-compression``, the prefill workers run with ``off`` (the bytes on the wire
are the KV's own), and the longest prompt runs once more at the first rate with ``lossless``:
TTFT both ways.

    python bench/kv_handoff_hosts.py --out /tmp/kv_hosts.json              # the full run
    python bench/kv_handoff_hosts.py --models small --rates-gbit 1 --tokens 256 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
WORKER_PORT, METRICS_PORT, ROUTER_PORT, RAW_PORT = 7100, 7200, 50051, 7300   # each host has its own ports
INSECURE = "--insecure-internal-plane"
COMPRESSION_FLAG = "--kv-compression"


@dataclass(frozen=True)
class Config:
    """One run: the models (presets or checkpoint directories), link rates, prompt sizes."""
    models: tuple[str, ...] = ("small", "qwen3-0.6b-kv")
    rates_gbit: tuple[float, ...] = (1.0, 10.0)
    tokens: tuple[int, ...] = (256, 1200, 4096)
    repeats: int = 3
    warmup: int = 1                          # requests of the shortest prompt first, not measured
    max_tokens: int = 2
    block_size: int = 16
    kv_cache_memory_bytes: int = 3 << 29     # 1.5 GiB: two 4096-token prompts of Qwen3-0.6B's KV shape
    compression: str = "auto"                # the lossless comparison: auto (where the CLI has --kv-compression), on, off
    kv_data_plane: str = ""                  # --kv-data-plane for both workers (tcp, grpc); "": the CLI's default
    pin_hosts: bool = False                  # prefill host on CPU 0, decode host on CPU 1 (see the module docstring)
    start_timeout_s: float = 300.0           # workers loading a model on a busy machine
    request_timeout_s: float = 900.0         # a 4096-token prompt of Qwen3-0.6B's KV shape: 250 s on a busy core
    seed: int = 0
    out: str | None = None
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: give at least one")
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"tokens must be positive, got {self.tokens}")
        if not self.rates_gbit or min(self.rates_gbit) <= 0:
            raise ValueError(f"rates_gbit must be positive, got {self.rates_gbit}")
        if self.repeats < 1 or self.warmup < 0 or self.max_tokens < 1:
            raise ValueError(f"repeats >= 1, warmup >= 0, max_tokens >= 1; got {self.repeats}, {self.warmup}, "
                             f"{self.max_tokens}")
        if self.compression not in ("auto", "on", "off"):
            raise ValueError(f"compression must be auto, on or off, got {self.compression!r}")
        if self.pin_hosts and len(os.sched_getaffinity(0)) < 2:
            raise ValueError("pin_hosts needs two CPUs this process may run on")


def _csv(kind: type) -> Any:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma list of {kind.__name__}: {text!r}") from None
    return parse


def parse_args(argv: Sequence[str] | None = None) -> Config:
    d = Config()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", type=_csv(str), default=d.models, help="model_maker presets or checkpoint dirs")
    ap.add_argument("--rates-gbit", type=_csv(float), default=d.rates_gbit, help="link rates, Gbit/s (tbf)")
    ap.add_argument("--tokens", type=_csv(int), default=d.tokens, help="prompt lengths (clamped to the model's "
                    "max_position_embeddings - max_tokens)")
    for name in ("repeats", "warmup", "max_tokens", "block_size", "kv_cache_memory_bytes", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--compression", choices=("auto", "on", "off"), default=d.compression,
                    help="the --kv-compression off/lossless comparison; auto: where the CLI has the flag")
    ap.add_argument("--kv-data-plane", choices=("", "tcp", "grpc"), default=d.kv_data_plane,
                    help="the workers' --kv-data-plane (default: the CLI's own)")
    ap.add_argument("--pin-hosts", action="store_true", help="prefill host on CPU 0, decode host on CPU 1")
    ap.add_argument("--start-timeout-s", type=float, default=d.start_timeout_s)
    ap.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--log-dir", default=None, help="the processes' logs (default: a new folder under /tmp)")
    try:
        return Config(**vars(ap.parse_args(argv)))
    except ValueError as exc:
        ap.error(str(exc))
        raise   # unreachable: error() exits


# ---- arithmetic --------------------------------------------------------------------------------
def kv_bytes(tokens: int, layers: int, kv_heads: int, head_dim: int, itemsize: int, block_size: int = 1) -> int:
    """KV bytes of a prompt: layers x 2 (K, V) x tokens x kv_heads x head_dim x itemsize, tokens
    rounded up to whole blocks (what is shipped)."""
    padded = -(-tokens // block_size) * block_size
    return layers * 2 * padded * kv_heads * head_dim * itemsize


def link_ms(nbytes: int, rate_bps: float) -> float:
    """The link's own time for nbytes at rate_bps."""
    return nbytes * 8 / rate_bps * 1e3


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Row:
    """One (model, rate, prompt size): medians over the repeats."""
    model: str
    rate_gbit: float
    tokens: int
    kv_bytes: int                 # measured: the prefill worker's counter for one prompt
    kv_bytes_formula: int         # layers x 2 x tokens (whole blocks) x kv_heads x head_dim x itemsize
    exposed_ms: float             # the router's kv_transfer_ms
    ttft_ms: float
    prefill_ms: float
    socket_ms: float
    compression: str = "-"                   # the prefill worker's --kv-compression; -: the CLI has none
    wire_bytes: int = 0                      # the router's kv_wire_bytes (encoded payload; 0: not reported)
    no_handoff: int = 0                      # measured requests whose timings carried no hand-off (left out)
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def link_ms(self) -> float:
        return link_ms(self.kv_bytes, self.rate_gbit * 1e9)

    @property
    def over_link(self) -> float:
        return self.exposed_ms / self.link_ms

    @property
    def over_socket(self) -> float:
        return self.exposed_ms / self.socket_ms if self.socket_ms > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "link_ms": self.link_ms, "exposed_over_link": self.over_link,
                "exposed_over_socket": self.over_socket}


COLUMNS = ("model", "Gbit/s", "KV comp.", "tokens", "KV MiB", "wire MiB", "link ms", "raw socket ms", "exposed hand-off ms",
           "exposed / link", "exposed / socket", "prefill ms", "TTFT ms")


def table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(COLUMNS) - 3)) + "|"]
    for r in rows:
        cells = [r.model, f"{r.rate_gbit:g}", r.compression, str(r.tokens), f"{r.kv_bytes / MiB:.2f}",
                 f"{r.wire_bytes / MiB:.2f}" if r.wire_bytes else "-",
                 f"{r.link_ms:.1f}", f"{r.socket_ms:.1f}", f"{r.exposed_ms:.1f}", f"{r.over_link:.2f}",
                 f"{r.over_socket:.2f}", f"{r.prefill_ms:.0f}", f"{r.ttft_ms:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- scripts run inside the hosts -----------------------------------------------------------------
CLIENT = r"""
import json, os, random, sys, time, urllib.request
from pdserve.services.client import Client
from pdserve.services.deployment.launcher import wait_serving
from pdserve.services.common.security import CLUSTER_TOKEN_ENV, Credentials

spec = json.loads(sys.argv[1])
creds = Credentials(os.environ[CLUSTER_TOKEN_ENV])
for address in [*spec["workers"], spec["router"]]:
    wait_serving(address, None, spec["start_timeout_s"], creds)

def counter(metrics, name="pdserve:kv_transfer_bytes_total"):
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.split("{", 1)[0].split(" ", 1)[0] == name)

rng = random.Random(spec["seed"])
out = []
with Client(spec["router"], timeout=spec["request_timeout_s"]) as client:
    # the warm-up requests: the shortest prompt, before any measured one
    plan = [(min(spec["tokens"]), True)] * spec["warmup"] + [(n, False) for n in spec["tokens"]
                                                            for _ in range(spec["repeats"])]
    for n, warmup in plan:
        prompt = [rng.randrange(2, spec["vocab"]) for _ in range(n)]   # fresh: no prefix-cache hits
        before = [counter(m) for m in spec["metrics"]]
        c = client.generate(prompt, max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        after = [counter(m) for m in spec["metrics"]]
        out.append({"tokens": n, "warmup": warmup, "timings": c.timings, "usage": c.usage,
                    "kv_bytes": [a - b for a, b in zip(after, before)]})
print(json.dumps(out))
"""

RAW_SOCKET = str(Path(__file__).resolve().parent / "raw_socket.py")   # the reference sender and receiver


# ---- one deployment on three hosts -------------------------------------------------------------
@dataclass
class ModelInfo:
    path: str
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    vocab: int
    max_len: int


def model_info(model: str) -> ModelInfo:
    """A preset's checkpoint (made if missing) or a checkpoint directory, and its KV shape."""
    from pdserve.engine.model_maker import ensure_model
    from pdserve.engine.presets import PRESETS
    path = Path(model) if model not in PRESETS else ensure_model(model)
    cfg = json.loads((path / "config.json").read_text())
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.get("torch_dtype", "float32")]
    return ModelInfo(str(path), model if model in PRESETS else path.name, cfg["num_hidden_layers"],
                     cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                     itemsize, cfg["vocab_size"], cfg["max_position_embeddings"])


def pinned(argv: list[str], host_index: int, pin: bool) -> list[str]:
    """argv run on its host's own CPU (host 1, the prefill host: the first CPU this process may
    use; host 2, the decode host: the second) when pin; else, and for the router's host, as is."""
    if not pin or host_index not in (1, 2):
        return argv
    cpu = sorted(os.sched_getaffinity(0))[host_index - 1]
    return ["taskset", "-c", str(cpu), *argv]


def cli_has_flag(role: str, flag: str) -> bool:
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", role, "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    return flag in done.stdout


class Deployment:
    """Router on host 0, prefill on host 1, decode on host 2, through the CLI."""

    def __init__(self, net: Any, cfg: Config, model: ModelInfo, log_dir: Path, env: dict[str, str],
                 prefill_extra: Sequence[str] = (), decode_extra: Sequence[str] = ()) -> None:
        self.net, self.cfg, self.model, self.log_dir, self.env = net, cfg, model, log_dir, env
        router, prefill, decode = net.hosts
        chunk = max(cfg.tokens)
        engine = ["--block-size", str(cfg.block_size), "--num-threads", "1", "--no-batch-invariant",
                  "--max-num-batched-tokens", str(max(chunk, 2048)), "--kv-cache-memory-bytes",
                  str(cfg.kv_cache_memory_bytes), "--kv-lease-max-s", str(cfg.request_timeout_s)]   # a long prefill's lease
        self.prefill = self._worker(prefill, 1, "prefill", 0, [*engine, *prefill_extra])
        self.decode = self._worker(decode, 2, "decode", 1, [*engine, *decode_extra])
        self._start(router, 0, "router", ["router", "--port", str(ROUTER_PORT), "--prefill", self.prefill[0],
                                       "--decode", self.decode[0], "--ready-timeout-s", str(cfg.start_timeout_s),
                                       "--disaggregation", "always"])   # every prompt's KV crosses the link
        self.router = f"{router.address}:{ROUTER_PORT}"

    def _start(self, host: Any, host_index: int, name: str, argv: list[str]) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            host.popen(pinned([sys.executable, "-m", "pdserve.services.cli", *argv, "--model", self.model.path,
                               "--host", host.address, INSECURE], host_index, self.cfg.pin_hosts),
                       env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)

    def _worker(self, host: Any, host_index: int, role: str, i: int, extra: list[str]) -> tuple[str, str]:
        self._start(host, host_index, role, [role, "--port", str(WORKER_PORT + i), "--metrics-port",
                                             str(METRICS_PORT + i), "--worker-id", f"{role}-{i}", *extra])
        return f"{host.address}:{WORKER_PORT + i}", f"{host.address}:{METRICS_PORT + i}"

    def drive(self, tokens: Sequence[int], seed: int) -> list[dict]:
        spec = {"router": self.router, "workers": [self.prefill[0], self.decode[0]],
                "metrics": [self.prefill[1], self.decode[1]], "tokens": list(tokens), "repeats": self.cfg.repeats,
                "warmup": self.cfg.warmup, "max_tokens": self.cfg.max_tokens, "vocab": self.model.vocab,
                "seed": seed, "start_timeout_s": self.cfg.start_timeout_s,
                "request_timeout_s": self.cfg.request_timeout_s}
        budget = self.cfg.start_timeout_s + self.cfg.request_timeout_s * (len(tokens) * self.cfg.repeats + self.cfg.warmup)
        done = self.net[0].run([sys.executable, "-c", CLIENT, json.dumps(spec)], env=self.env, cwd=REPO_ROOT,
                               timeout=budget, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the client failed:\n{done.stderr[-3000:]}\n{self.logs()}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-1500:] for p in self.log_dir.glob("*.log"))


def raw_socket_ms(net: Any, sizes: Sequence[int], repeats: int, timeout: float = 120.0,
                  pin: bool = False) -> dict[int, float]:
    """Median ms of a raw TCP send of each size (and a one-byte answer), prefill host -> decode host."""
    import select
    sender, receiver = net[1], net[2]
    rx = receiver.popen(pinned([sys.executable, RAW_SOCKET, "serve", receiver.address, str(RAW_PORT), str(timeout)],
                               2, pin), stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([rx.stdout], [], [], timeout)
        if not ready or not rx.stdout.readline().startswith("ready"):
            raise RuntimeError(f"the raw-socket receiver did not start within {timeout:g}s")
        done = sender.run(pinned([sys.executable, RAW_SOCKET, "send", receiver.address, str(RAW_PORT),
                                  json.dumps(list(sizes)), str(repeats), str(timeout)], 1, pin),
                          timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the raw-socket sender failed: {done.stderr[-2000:]}")
    finally:
        rx.kill()
        rx.wait(10)
        receiver.procs.remove(rx)
    return {int(n): median(v) * 1e3 for n, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def rows_from(samples: list[dict], model: ModelInfo, rate_gbit: float, block_size: int, socket: dict[int, float],
              compression: str = "-") -> list[Row]:
    """Medians per prompt size of the measured (non-warm-up) requests; one whose timings carry no
    hand-off (kv_transfer_ms 0: a router that finished before the prefill's KVDelivered) is left
    out and counted."""
    rows = []
    for n in dict.fromkeys(s["tokens"] for s in samples):
        measured = [s for s in samples if s["tokens"] == n and not s["warmup"]]
        cached = [s["usage"].get("cached_tokens", 0) for s in measured]
        if any(cached):
            raise RuntimeError(f"{n}-token prompts hit the prefix cache ({cached}): not fresh")
        got = [s for s in measured if s["timings"]["kv_transfer_ms"] > 0]
        if not got:
            raise RuntimeError(f"no {n}-token request reported its hand-off (kv_transfer_ms 0 in every one)")
        nbytes = int(median([s["kv_bytes"][0] for s in got]))
        series = {k: [s["timings"][k] for s in got] for k in ("kv_transfer_ms", "ttft_ms", "prefill_ms")}
        wire = int(median([s["timings"].get("kv_wire_bytes") or 0 for s in got]))
        rows.append(Row(model.name, rate_gbit, n, nbytes,
                        kv_bytes(n, model.layers, model.kv_heads, model.head_dim, model.itemsize, block_size),
                        median(series["kv_transfer_ms"]), median(series["ttft_ms"]), median(series["prefill_ms"]),
                        socket.get(nbytes, float("nan")), compression, wire, len(measured) - len(got), series))
    return rows


def measure(cfg: Config, model: ModelInfo, rate_gbit: float, tokens: Sequence[int], log_dir: Path,
            compression: str | None = None) -> list[Row]:
    """One deployment at one rate: the prompts, then the raw socket for the bytes they shipped."""
    from pdserve.services.deployment import netns
    from pdserve.services.common.security import CLUSTER_TOKEN_ENV, new_token
    env = {**os.environ, CLUSTER_TOKEN_ENV: new_token(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    extra = [COMPRESSION_FLAG, compression] if compression else []
    plane = ["--kv-data-plane", cfg.kv_data_plane] if cfg.kv_data_plane else []
    run_dir = log_dir / f"{Path(model.name).name}-{rate_gbit:g}g-{compression or 'plain'}-{cfg.kv_data_plane or 'default'}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with netns.HostNetwork(3, int(rate_gbit * 1e9)) as net:
        d = Deployment(net, cfg, model, run_dir, env, prefill_extra=[*extra, *plane], decode_extra=plane)
        samples = d.drive(tokens, cfg.seed + int(rate_gbit * 1000) + (7 if compression else 0))
        measured = sorted({int(median([s["kv_bytes"][0] for s in samples if s["tokens"] == n and not s["warmup"]]))
                           for n in tokens})
        socket = raw_socket_ms(net, measured, cfg.repeats, pin=cfg.pin_hosts) if all(measured) else {}
    return rows_from(samples, model, rate_gbit, cfg.block_size, socket, compression or "-")


def run(cfg: Config) -> dict[str, Any]:
    log_dir = Path(cfg.log_dir or f"/tmp/kv_handoff_hosts-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    has_flag = cli_has_flag("prefill", COMPRESSION_FLAG)
    if cfg.compression == "on" and not has_flag:
        raise SystemExit(f"--compression on: `pdserve prefill --help` lists no {COMPRESSION_FLAG}")
    compress = cfg.compression == "on" or (cfg.compression == "auto" and has_flag)
    plain = "off" if has_flag else None   # never auto: it may turn lossless on a slow link mid-run
    rows: list[Row] = []
    for name in cfg.models:
        model = model_info(name)
        tokens = sorted({min(n, model.max_len - cfg.max_tokens) for n in cfg.tokens})
        print(f"# {model.name}: {model.layers} layers x {model.kv_heads} KV heads x {model.head_dim}, "
              f"{model.itemsize}-byte KV; prompts {tokens}", flush=True)
        for rate in cfg.rates_gbit:
            rows += measure(cfg, model, rate, tokens, log_dir, compression=plain)
            print(table(rows[-len(tokens):]), flush=True)
        if compress:   # the off row is the first rate's, longest prompt, above
            rows += measure(cfg, model, cfg.rates_gbit[0], [tokens[-1]], log_dir, compression="lossless")
            print(table(rows[-1:]), flush=True)
    return {"config": asdict(cfg), "load_average": os.getloadavg(), "logs": str(log_dir),
            "compression_compared": compress, "rows": [r.as_dict() for r in rows], "table": table(rows)}


def _git(*argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    return done.stdout.strip()


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")   # unwinds through every HostNetwork's close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    from pdserve.services.deployment import netns
    ok, why = netns.available()
    if not ok:
        print(f"cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    netns.sweep_stale()
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    commit, dirty = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    print(f"# commit {commit}" + (f" with {len(dirty.splitlines())} modified tracked files" if dirty else ""),
          flush=True)
    result = {"commit": commit, "modified_files": dirty.splitlines(), **run(cfg)}
    result["seconds"] = time.monotonic() - started
    print(result["table"])
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
