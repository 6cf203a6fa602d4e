"""What every configuration section shares: strict models and the units of time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

DAY_SECONDS = 86_400.0
YEAR_SECONDS = 366 * DAY_SECONDS  # the scheduler cannot hold dates past year 9999


class _Section(BaseModel):
    # Infinity and NaN are valid TOML floats but no duration, rate or share the agent can use.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before", check_fields=False)
    @classmethod
    def _true_or_false(cls, value: Any, info: ValidationInfo) -> Any:
        """A switch is true or false: a TOML boolean, or the word in an environment variable (any
        case). pydantic alone would also take "yes", "on", "1" or 1, which a slip can give."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None or field.annotation is not bool or isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ValueError(f"expected true or false, got {value!r}")

    @field_validator("*", check_fields=False)
    @classmethod
    def _no_nul_character(cls, value: Any) -> Any:
        """No path, name, URL or command holds a NUL (TOML can write one as "\\u0000")."""
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str | Path) and "\x00" in str(item):
                raise ValueError("holds a NUL character")
        return value
