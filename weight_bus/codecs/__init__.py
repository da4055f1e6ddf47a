"""Weight codecs for the weight bus (wire formats for trainer -> rollout weight pushes).

Codecs live in submodules, e.g. ``from weight_bus.codecs import mxfp8; q, s = mxfp8.quantize(w)``.
"""

from weight_bus.codecs import mxfp8

__all__ = ["mxfp8"]
