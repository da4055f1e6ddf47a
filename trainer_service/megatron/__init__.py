"""The Megatron training backend (``trainer.backend=megatron``): every module that imports megatron lives here.

    backend.py         MegatronBackend: the Backend interface over megatron-core model chunks
    parallel.py        torch.distributed and megatron's parallel groups (TP, PP, EP, DP)
    model.py           the bridge's provider configured (local spec, no TE fusions), DDP, the optimizer
    forward.py         masks, sequence padding, one pipeline stage's output (fused log-probs), megatron's schedule
    fused_attention.py FusedCoreAttention: scaled_dot_product_attention in place of the eager core attention
    step.py            the step's figures reduced over ranks; clip and step, or skip a non-finite one
    checkpoint.py      model, optimizer and RNG states, one file per rank
    lora.py            megatron-bridge PEFT LoRA as a pre-wrap hook
    routing_replay.py  R3 through megatron-core's RouterReplay
    cpu_shims.py       what megatron needs on a CPU torch, Python 3.11 and without Transformer Engine
    beam/              Beam on megatron-core: bridge, provider, custom modules

Importing these modules imports no megatron (each imports it inside its functions, after ``cpu_shims.apply()``),
except ``fused_attention.py`` and ``beam/``'s bridge, provider and modules, which ``model.py`` and
``beam.register()`` import once the shims are in place.
"""
