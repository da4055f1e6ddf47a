"""What a restarted coordinator reads before it produces: how many groups earlier coordinators pushed and the trainer
took (so only the rest of the run is produced), and the prompt cursor (so the prompt stream continues after them).
Reads at start ride out a Redis outage."""

from __future__ import annotations

import logging

logger = logging.getLogger("coordinator")


def remaining_groups(config, pushed: int, steps_trained: int) -> tuple[int, int]:
    """(groups this coordinator still produces, groups already queued ahead of them).

    A fresh run: (num_steps x B, 0). A coordinator restarted mid-run: earlier coordinators ``pushed`` some groups;
    the trainer has taken ``steps_trained`` steps (its version minus RedisKeys.version_offset), so the
    rest of what was pushed is still ahead in the queue, and only the remainder of the run is produced.
    """
    B = config.groups_per_step
    queued = max(0, pushed - steps_trained * B)
    total = max(0, config.num_steps * B - pushed)
    if pushed:
        logger.warning(
            "coordinator restart: %d groups pushed before (trainer at step %d, %d still queued); "
            "producing the remaining %d",
            pushed,
            steps_trained,
            queued,
            total,
        )
    return total, queued


async def startup_read(read, what: str, timeout_s: float = 120.0):
    """A read of the coordinator's start, retried through a Redis outage (channels/retry.py): a coordinator started
    while Redis restarts waits for it instead of failing and being restarted."""
    from channels.retry import retry_async

    return await retry_async(read, f"coordinator start: reading {what}", timeout_s)


async def resume_prompts(task, queue) -> None:
    """A restarted coordinator continues the prompt stream after the groups already pushed (the prompt cursor).

    A cursor of another task, seed or dataset size cannot be continued: that task starts from its top, said loudly.
    """
    cursor = await startup_read(queue.prompt_cursor, "the prompt cursor")
    if cursor is None:
        logger.warning(
            "coordinator restart: no prompt cursor in Redis; task %s starts from its first prompt", task.name
        )
        return
    try:
        if cursor.task != task.name:
            raise ValueError(f"the cursor is for task {cursor.task!r}, this run's task is {task.name!r}")
        task.restore(dict(cursor.position))
    except (ValueError, KeyError) as error:
        logger.warning(
            "coordinator restart: cannot continue the prompt stream (%s); task %s starts from its first prompt",
            error,
            task.name,
        )
        return
    logger.warning(
        "coordinator restart: task %s continues at %s (after group %s)", task.name, cursor.position, cursor.group_id
    )
