"""Names of every Redis key and stream of a run, in one place (producer and consumer agree here)."""

from __future__ import annotations

from dataclasses import dataclass


def as_text(value: bytes | str | int) -> str:
    """A Redis reply field (entry id, key, value) as text: the client returns bytes unless told to decode."""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class RedisKeys:
    """Key names for run ``run_id``; all live under ``fleetrl:<run_id>:``."""

    run_id: str

    def _key(self, suffix: str) -> str:
        return f"fleetrl:{self.run_id}:{suffix}"

    @property
    def trajectories(self) -> str:
        """Stream of encoded TrajectoryGroup records (field ``g``)."""
        return self._key("trajectories")

    @property
    def trainer_group(self) -> str:
        """Consumer group name of the trainers on the trajectory stream."""
        return "trainers"

    def trainer_group_info(self, xinfo_groups_reply: list[dict]) -> dict | None:
        """The trainers' entry of an ``XINFO GROUPS <trajectories>`` reply (name as str or bytes), or None.

        Its ``lag`` is the queue depth (entries not yet delivered) that the coordinator and trainer report.
        """
        for group in xinfo_groups_reply:
            if group["name"] in (self.trainer_group, self.trainer_group.encode()):
                return group
        return None

    @property
    def dead_letters(self) -> str:
        """List of undecodable stream payloads, kept for inspection."""
        return self._key("dead_letters")

    @property
    def policy_version(self) -> str:
        """Latest policy version the trainer has published (int as string)."""
        return self._key("version")

    @property
    def version_offset(self) -> str:
        """The trainer's policy version minus the steps it has taken (int as string; SET by the trainer at start and
        after a step that published nothing). A trainer restored from a checkpoint older than the latest published
        version publishes it as latest + 1 (raising it); a non-finite step takes a step without a version (lowering
        it). The coordinator maps slots to versions by 'version - offset = steps' and follows every change."""
        return self._key("version_offset")

    @property
    def prompt_cursor(self) -> str:
        """Encoded PromptCursor: the prompt stream position of the earliest group not yet pushed (set with each push)."""
        return self._key("prompt_cursor")

    def manifest(self, version: int) -> str:
        """Encoded WeightManifest of ``version``."""
        return self._key(f"weights:{version}")

    def ipc_buckets(self, version: int) -> str:
        """Encoded CudaIpcVersion of ``version`` (transport 'ipc': the buckets on the trainer's GPU)."""
        return self._key(f"weights:{version}:ipc")

    @property
    def weight_announcements(self) -> str:
        """Stream of published versions (field ``v``); rollout servers follow it."""
        return self._key("weights:announce")

    @property
    def fleet(self) -> str:
        """Hash server_id -> encoded VersionReport."""
        return self._key("fleet")

    @property
    def fleet_changes(self) -> str:
        """Stream of the server ids whose VersionReport just changed (field ``s``): the coordinator wakes on it."""
        return self._key("fleet:changes")

    def metrics(self, role: str) -> str:
        """Stream of encoded MetricsReport records of ``role`` (field ``m``), ended by a RoleDone (field ``d``)."""
        return self._key(f"metrics:{role}")

    @property
    def control(self) -> str:
        """Stream of control messages to the roles (field ``c``), e.g. stop."""
        return self._key("control")

    @property
    def nccl_group(self) -> str:
        """Encoded NcclGroup: the current NCCL broadcast group (generation, unique id, members)."""
        return self._key("weights:nccl:group")

    @property
    def nccl_round(self) -> str:
        """Encoded NcclRound: the version being broadcast over NCCL and its chunk plan inputs."""
        return self._key("weights:nccl:round")

    @property
    def nccl_members(self) -> str:
        """Hash member id -> encoded NcclMember heartbeat of each NCCL subscriber."""
        return self._key("weights:nccl:members")

    def agent_session(self, session_id: str) -> str:
        """Hash of an external agent's session: ``h`` its AgentSessionRecord, ``t<i>`` its turns (AgentTurn), ``r<i>``
        the routed experts (Array) of its last generated turn i. Expires with its group (``agent_group``)."""
        return self._key(f"agent:session:{session_id}")

    def agent_group(self, group_uid: str) -> str:
        """Encoded AgentGroupRecord; expires once its group cannot be open or remembered any more."""
        return self._key(f"agent:group:{group_uid}")

    @property
    def openai_door_port(self) -> str:
        """The OpenAI door's port (int as string) when it was picked at start (``agent.openai_port: 0``): a restarted
        coordinator of the run listens on it again, so agents keep their base URL."""
        return self._key("agent:openai_door_port")

    @property
    def agent_api_port(self) -> str:
        """The agent gRPC API's port (int as string) when it was picked at start (``agent.port: 0``): a restarted
        coordinator of the run listens on it again, so agent SDK clients keep their address."""
        return self._key("agent:api_port")
