"""Beam on megatron-core: the megatron-bridge bridge, the model provider and the custom modules.

    bridge.py     BeamBridge: HF config -> BeamModelProvider, HF <-> Megatron weight mapping (registered on import)
    provider.py   BeamModelProvider and the Beam layer spec (local megatron-core modules + the custom ones)
    modules.py    what stock megatron-core cannot express: SSMax, sliding window with padding, sandwich norms
                  with depth-scaled residuals, fp32 router, logit soft-cap, HF-rounded RMSNorm

``register()`` must run before ``AutoBridge`` sees a Beam checkpoint; ``MegatronBackend`` calls it. Figures and
the list of custom parts: docs/models/beam.md, "Megatron path".
"""

from __future__ import annotations


def register() -> None:
    """Register ``model_type: "beam"`` with transformers and ``BeamForCausalLM`` with megatron-bridge (idempotent).

    Applies the CPU/Python shims first: megatron must not be imported before them.
    """
    from trainer_service.megatron import cpu_shims

    cpu_shims.apply()
    import modeling.beam  # noqa: F401  (AutoConfig / AutoModelForCausalLM know "beam")
    import trainer_service.megatron.beam.bridge  # noqa: F401  (@register_bridge runs on import)
