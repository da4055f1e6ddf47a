"""Rollout service: vLLM AsyncLLM behind a gRPC streaming API."""
