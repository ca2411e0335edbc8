"""The load generator behind ``pdserve bench``: workloads (datasets, offline), arrival schedules,
the clients that time each request (the router's gRPC API, OpenAI-compatible HTTP), the run loop,
and the summaries (TTFT, TPOT, ITL, e2el, throughput, goodput). bench/ holds drivers built on it."""
