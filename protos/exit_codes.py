"""Process exit codes: the contract between a role process and the launcher that supervises it.

A role exits with ``EXIT_CANNOT_RESTART`` when it refuses to run for a reason that a restart cannot change (its
configuration, its environment, the run's state: a trainer with no checkpoint behind a published version). The
launchers (launcher/supervision.py) then end the run at once with the role's own message instead of restarting
it. Any other non-zero code is a crash, restarted by ``launcher.restart``.
"""

from __future__ import annotations

EXIT_CANNOT_RESTART = 78  # sysexits.h EX_CONFIG
