"""Weight bus: versioned, bucketed weight broadcast from the trainer to rollout servers.

Imports only ``protos`` and ``channels`` of fleetrl (its Redis side, the manifests, versions, announcements and
fleet reports, is ``channels.version_board``). Modules:

- ``packing``: buckets + manifest (crc32 per tensor), wire codecs (bf16 pass-through, mxfp8), the
  metadata-only layout planner, the (optionally dequantizing) reader.
- ``pipeline``: two rotating buffers between packing and sending.
- ``sender`` / ``receiver``: the trainer's and the rollout server's side over ``tcp``; ``snapshot``:
  published versions on disk for receivers whose publisher is unreachable.
- ``nccl`` (publisher, subscriber), ``nccl_group`` (protocol and decisions, CPU), ``nccl_device``
  (device buffers and streams), ``nccl_comm`` (the thin NCCL layer; cupy imported lazily).
- ``codecs.mxfp8``: the MXFP8 encoder/decoder.
"""
