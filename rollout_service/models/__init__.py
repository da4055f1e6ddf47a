"""Out-of-tree vLLM models, registered by the ``vllm.general_plugins`` entry point ``fleetrl_beam``.

vLLM calls ``register()`` in every process it starts (front end, engine core, workers) before it
reads a model config, so the HF config class must be registered here too, not only the model.
"""

from __future__ import annotations


def register() -> None:
    """Make ``model_type: "beam"`` / ``BeamForCausalLM`` checkpoints loadable by vLLM."""
    from vllm import ModelRegistry

    import modeling.beam  # noqa: F401  (registers BeamConfig with transformers' AutoConfig)

    if "BeamForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("BeamForCausalLM", "rollout_service.models.beam:BeamForCausalLM")
