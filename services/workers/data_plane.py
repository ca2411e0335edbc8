"""A worker's raw TCP KV data plane (services/kv_transfer/tcp_*.py), from its settings: the
decode side's listener, the prefill side's sender. Ray deployments keep their own transport."""
from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING

from pdserve.services.common.proofs import is_wildcard
from pdserve.services.common.security import Credentials

if TYPE_CHECKING:
    from pdserve.services.kv_transfer.base import KVSink
    from pdserve.services.kv_transfer.tcp_receiver import KVDataListener
    from pdserve.services.kv_transfer.tcp_transport import TcpKVSender
    from pdserve.services.workers.options import WorkerOptions

log = logging.getLogger(__name__)


def _tls(credentials: Credentials, server: bool) -> ssl.SSLContext | None:
    from pdserve.services.kv_transfer import tcp_wire   # lazy: torch only where a data plane runs
    if credentials.tls is None:
        return None
    files = (str(credentials.tls.cert), str(credentials.tls.key), str(credentials.tls.ca))
    return tcp_wire.server_context(*files) if server else tcp_wire.client_context(*files)


def kv_data_listener(sink: "KVSink", options: "WorkerOptions") -> "KVDataListener | None":
    """Decode: the listener on --host:--kv-data-port, or None: --kv-data-plane grpc, a Ray
    deployment, a KV address advertised in place of this worker's own (a relay or a translated
    address: only the gRPC stream goes there), or a wildcard --host with no address to name."""
    # lazy: torch only when this runs
    from pdserve.services.kv_transfer.tcp_receiver import DataPlaneLimits, KVDataListener
    wc = options.config
    if wc.kv_data_plane != "tcp" or options.kv_address or wc.kv_advertise_address:
        return None
    if is_wildcard(options.host):
        log.warning("no TCP KV data plane: --host %s names no address to advertise; KV goes over gRPC", options.host)
        return None
    listener = KVDataListener(sink, options.host, wc.kv_data_port, cluster_token=options.credentials.cluster_token,
                              tls=_tls(options.credentials, server=True),
                              limits=DataPlaneLimits(max_connections=wc.kv_data_max_connections)).start()
    log.info("KV data plane listening on %s", listener.address())
    return listener


def kv_data_sender(options: "WorkerOptions") -> "TcpKVSender | None":
    """Prefill: the TCP sender used for targets that name a data plane, or None (--kv-data-plane grpc)."""
    from pdserve.services.kv_transfer.tcp_transport import TcpKVSender   # lazy: torch only when this runs
    wc = options.config
    if wc.kv_data_plane != "tcp":
        return None
    return TcpKVSender(cluster_token=options.credentials.cluster_token, tls=_tls(options.credentials, server=False),
                       kv_compression=wc.kv_compression)
