"""vLLM's reload warnings about layers that hold no checkpoint tensors, dropped where they are false (vLLM worker).

vLLM's layerwise reload counts every parameter and buffer of a layer as loadable. A layer whose only tensors are
non-persistent buffers derived from the config (``RotaryEmbedding.cos_sin_cache``) never receives one from a
checkpoint, so each reload warns "RotaryEmbedding: Failed to load weights" and then puts the layer's own buffer back,
which is what it should serve (issue 25 saw it once per update on every MXFP8 run). ``quiet_derived_buffer_warnings``
drops that warning for a layer class only if every layer of that class in the model holds non-persistent buffers
and nothing else; a class with a parameter or a persistent buffer keeps its warning, since it then did miss weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_TO_LOAD = ": Failed to load weights"

log = logging.getLogger(__name__)


def derived_buffer_classes(model: torch.nn.Module) -> frozenset[str]:
    """Class names whose every layer in ``model`` holds only non-persistent buffers (layers holding nothing aside)."""
    derived: set[str] = set()
    loadable: set[str] = set()
    for module in model.modules():
        params = [name for name, p in module._parameters.items() if p is not None]
        buffers = {name for name, b in module._buffers.items() if b is not None}
        if not params and not buffers:
            continue  # nothing to load: vLLM does not warn about it
        name = type(module).__name__
        if params or not buffers <= module._non_persistent_buffers_set:
            loadable.add(name)
        else:
            derived.add(name)
    return frozenset(derived - loadable)


class DerivedBufferWarnings(logging.Filter):
    """Drops vLLM's "<Class>: Failed to load weights" for the classes given; every other record passes."""

    def __init__(self, class_names: frozenset[str]):
        super().__init__()
        self.class_names = class_names
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(FAILED_TO_LOAD) and message[: -len(FAILED_TO_LOAD)] in self.class_names:
            self.dropped += 1
            return False
        return True


@contextmanager
def quiet_derived_buffer_warnings(model: torch.nn.Module) -> Iterator[DerivedBufferWarnings]:
    """Around one reload: vLLM's false "Failed to load weights" for derived-buffer layers is dropped (docstring)."""
    names = derived_buffer_classes(model)
    notices = DerivedBufferWarnings(names)
    logger = logging.getLogger(LAYERWISE_LOGGER)
    logger.addFilter(notices)
    try:
        yield notices
    finally:
        logger.removeFilter(notices)
    if notices.dropped:
        log.debug("dropped %d reload warnings for layers holding only derived buffers (%s)", notices.dropped, names)
