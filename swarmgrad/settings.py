"""The base of every settings model (run configuration, averaging, timing): frozen, strict, and
invalid input raised as one ``ConfigError`` line that names the field."""

from __future__ import annotations

import pydantic

from swarmgrad.errors import ConfigError


def describe_validation_error(error: pydantic.ValidationError) -> str:
    """pydantic's first error as one line: ``field.path: what is wrong``."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    where = ".".join(str(part) for part in first["loc"])
    message = str(cause) if isinstance(cause, Exception) else first["msg"]
    return f"{where}: {message}" if where else message


class SettingsError(ConfigError):
    """A settings model refused its input: one line, and pydantic's problems (their locations
    relative to the model) for callers that name the source of each value (peer/options.py)."""

    def __init__(self, message: str, problems: list[dict]):
        super().__init__(message)
        self.problems = problems


def flag(name: str, short: str | None = None) -> dict:
    """A field's CLI flag where it differs from the field's name, and a short form
    (``Field(json_schema_extra=flag("identity", "-i"))``); swarmgrad/peer/options.py reads it."""
    return {"flag": name} if short is None else {"flag": name, "short": short}


class SettingsModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as error:
            raise SettingsError(f"{type(self).__name__}: {describe_validation_error(error)}", error.errors()) from None

    @classmethod
    def parse(cls, data: dict, source: str = ""):
        """From plain data (a manifest, a file); bad input is one ConfigError naming ``source`` and the field."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source or cls.__name__}: expected a table of settings, got {type(data).__name__}")
        try:
            return cls(**data)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}" if source else str(error)) from None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")
