"""The pieces every dialect's request schemas are built of: integers as JSON Schema counts
them, an object the caller defines, and the bounds on a conversation's size."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

MAX_MESSAGES = 1024
MAX_TOOLS = 128
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer; strict mode would refuse it. true stays refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(integral)]


class OpenObject(BaseModel):
    """A JSON object the caller defines (a JSON schema, tool parameters): taken as it is."""

    model_config = ConfigDict(extra="allow")
