"""Deployment helpers: ``python -m deploy.render`` writes Kubernetes manifests for a run config.

This package imports ``protos`` only (the config schema), never the roles: rendering manifests must work on a
laptop without torch, vLLM or Megatron installed.
"""
