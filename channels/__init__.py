"""The run's typed Redis channels, below the roles and the weight bus (it imports only protos).

- ``trajectory_stream``: the coordinator's pushes and the trainer's consumer-group reads of trajectory groups.
- ``control_stream``: operator commands (SYNC, SET key value) from the admin API to the trainer.
- ``version_board``: the version pointer and offset, manifests, IPC records, announcements, fleet reports.
- ``metrics_stream``: every role's metrics reports and end-of-run markers (``MetricsReport``, ``RoleDone``).
- ``nccl_board``: the NCCL broadcast's group, round and subscriber heartbeats.
- ``agent_sessions``: external agents' sessions and groups, for a restarted coordinator.
- ``retry``: the one retry policy for Redis outages.
"""
