"""The run's typed Redis channels, below the roles and the weight bus (it imports only protos).

- ``trajectory_stream``: the coordinator's pushes and the trainer's consumer-group reads of trajectory groups.
- ``version_board``: the version pointer and offset, manifests, IPC records, announcements, fleet reports, RoleDone.
- ``agent_sessions``: external agents' sessions and groups, for a restarted coordinator.
- ``retry``: the one retry policy for Redis outages.
"""
