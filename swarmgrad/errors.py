"""Errors that reach users. Each message says what went wrong and what to do about it."""


class SwarmgradError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero, without a traceback."""


class ConfigError(SwarmgradError, ValueError):
    """A setting, flag, address or file given by the user is invalid."""


class StartupError(SwarmgradError, RuntimeError):
    """A node could not start or could not join the swarm."""
