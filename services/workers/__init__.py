"""Worker processes: the engine in one role (prefill, decode, colocated) behind its gRPC services."""
