"""The OpenAI door's refusals as OpenAI's clients read them: an HTTP status and an ``error`` object whose ``param``
names the field as the request spelled it (the chat route's names, or a route's own through ``renames``).

Used for plain answers (the door's middleware) and for refusals that come after a stream's headers went out
(sent as an error event, ``door_stream.py``).
"""

from __future__ import annotations

from coordinator.agents.door_requests import DoorRefused
from coordinator.agents.errors import AgentRefused

__all__ = ["ERROR_TYPE", "STATUS", "refusal_of"]

STATUS = {"invalid": 400, "not_found": 404, "precondition": 409, "denied": 403, "exhausted": 429, "unavailable": 503}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",  # as OpenAI's API answers a wrong method
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
# The core's names of fields that the door's clients send under OpenAI's names.
DOOR_FIELDS = {"sampling.temperature": "temperature", "prompt_token_ids": "messages", "token_ids": "messages"}


def refusal_of(error: Exception, renames: dict | None = None) -> tuple[int, dict, int] | None:
    """``(status, error object, retry_after_ms)`` of a refusal (``DoorRefused``, ``AgentRefused``), else None.

    ``renames`` maps the chat route's field names to a route's own (``messages`` is ``input`` for
    ``/v1/responses``): ``param`` and a message that starts with the field are renamed."""
    if isinstance(error, DoorRefused):
        status, message, param, retry_after_ms = error.status, str(error), error.param, error.retry_after_ms
    elif isinstance(error, AgentRefused):
        field, _, rest = str(error).partition(":")
        param = field if rest and field.replace("_", "").replace(".", "").isalnum() else None
        message = str(error)
        if param in DOOR_FIELDS:  # the door's clients sent it under OpenAI's name
            param, message = DOOR_FIELDS[param], DOOR_FIELDS[param] + ":" + rest
        status, retry_after_ms = STATUS[error.kind], error.retry_after_ms
    else:
        return None
    if renames and param in renames:
        if message.startswith(param):
            message = renames[param] + message[len(param) :]
        param = renames[param]
    body = {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param}
    return status, body, retry_after_ms
