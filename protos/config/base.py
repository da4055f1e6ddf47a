"""The strict base of every config section: unknown keys and bad assignments are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
