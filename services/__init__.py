"""pdserve services: router, prefill/decode/colocated workers, KV transport, client, CLI."""
