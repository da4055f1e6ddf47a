"""``python -m trainer_service.torchrun ARGS``: torchrun (``torch.distributed.run``, same arguments) that keeps a
rank's refusal.

torchrun exits 1 whenever a rank fails, so a rank's EXIT_CANNOT_RESTART (protos/exit_codes.py: a configuration, a
run state or a disk it refuses) used to reach the supervisor above (``fleetrl demo``, a Kubernetes pod's restart
policy) as an ordinary crash, and the trainer was restarted into the same refusal until the restarts ran out. Here
a failure in which any rank exited EXIT_CANNOT_RESTART exits EXIT_CANNOT_RESTART; any other failure exits 1 as
torchrun does.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from protos.exit_codes import EXIT_CANNOT_RESTART


def exit_code_of(error: ChildFailedError) -> int:
    """EXIT_CANNOT_RESTART when a failed rank exited with it (the others were then stopped by torchrun), else 1."""
    codes = {failure.exitcode for failure in error.failures.values()}
    return EXIT_CANNOT_RESTART if EXIT_CANNOT_RESTART in codes else 1


def main(argv: list[str] | None = None) -> None:
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)  # torchrun prints the failed ranks' summary itself
    except ChildFailedError as error:
        raise SystemExit(exit_code_of(error)) from None


if __name__ == "__main__":
    main()
