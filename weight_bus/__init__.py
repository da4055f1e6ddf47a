"""Weight bus: versioned, bucketed weight broadcast from the trainer to rollout servers.

Imports only ``protos`` of fleetrl. See ``packing`` (buckets + manifest), ``tcp`` (CPU transport) and
``rendezvous`` (the Redis side: manifests, versions, announcements).
"""
