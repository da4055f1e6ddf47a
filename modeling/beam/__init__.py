"""Beam (501B-A23B MoE): config, transformers reference model and a tiny random checkpoint builder.

Importing this package registers ``model_type: "beam"`` with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``, so ``from_pretrained`` on a local Beam checkpoint works afterwards.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from modeling.beam.configuration_beam import BeamConfig
from modeling.beam.modeling_beam import BeamForCausalLM, BeamModel, BeamPreTrainedModel

AutoConfig.register(BeamConfig.model_type, BeamConfig, exist_ok=True)
AutoModelForCausalLM.register(BeamConfig, BeamForCausalLM, exist_ok=True)

__all__ = ["BeamConfig", "BeamForCausalLM", "BeamModel", "BeamPreTrainedModel"]
