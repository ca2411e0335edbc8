"""The engine's KV cache: the paged pool and its prefix cache, the tiers under it (host RAM, disk),
the hand-off connector and its events."""
