"""Sessions opened by ``task_id``: the prompt comes from the coordinator's task, and so may the reward.

The rule (docs/agents.md): a session of a task group submitted *with* a reward is trained with the agent's reward;
one submitted *without* a reward is scored at once by the run's reward function (coordinator/tasks.py: the echo
reward, or the dataset's ``coordinator.reward_fn`` with its overlong penalty), on the session's last generated
turn, read as the response to the task's prompt (earlier turns are the agent's way there; appended tool tokens
are not the model's). ``SetReward`` may still replace that reward until the group is complete: the agent's word
is final.

Task ids: ``echo-<n>`` for the echo task (the n-th prompt of the run's seeded echo stream, as the coordinator
draws it), the problem id for a dataset (its ``id`` column, ``extra_info.index``, else ``line-<n>``/``row-<n>``).
"""

from __future__ import annotations

import logging

from coordinator.agents.errors import InvalidArgument
from coordinator.agents.groups import Session
from coordinator.scheduler import SchedulerStats
from coordinator.tasks import Task, TaskPrompt

logger = logging.getLogger(__name__)


class AgentTasks:
    """The coordinator's task as agents use it: a prompt by id, the reward of a session."""

    def __init__(self, task: Task, stats: SchedulerStats):
        self.task = task
        self.stats = stats  # reward_errors

    def prompt(self, task_id: str) -> TaskPrompt:
        try:
            return self.task.prompt_by_id(task_id)
        except ValueError as error:
            raise InvalidArgument(f"task_id: {error} (task {self.task.name})") from error

    async def score(self, prompt: TaskPrompt, session: Session) -> float:
        """The run's reward of the session's last generated turn (a failing reward function scores 0, counted)."""
        turn = session.last_generated()
        [result] = await self.task.score(prompt, [list(turn.token_ids) if turn else []])
        if result.error is not None:
            self.stats.reward_errors += 1
            logger.warning(
                "agent session %s: the reward function failed (%s); reward 0", session.session_id, result.error
            )
        return result.reward
