"""The agent gateway: external agents' sessions, turns and groups (``sessions.SessionBook``), their slots in the
scheduler's order (``slots.AgentSlots``), their records in Redis, the agent gRPC API (``api.py``) and the
OpenAI-compatible HTTP door (``door*.py``)."""
