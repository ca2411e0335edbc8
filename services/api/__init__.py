"""The public front ends: the gRPC Router API and the OpenAI-compatible HTTP API, over one request front."""
