"""The shared floor under both wings: settings and flags, ports and topology, security and proofs,
gRPC setup, proto conversion, tracing, metrics and small process helpers. It imports only the
engine and itself; the serving wing (api, router, workers, kv_transfer) and the operations wing
(cli, deployment, ray_deploy, planner, loadtest) import it."""
