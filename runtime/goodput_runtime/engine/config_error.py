"""The error of settings that cannot work together on this machine and model."""


class EngineConfigError(ValueError):
    """The settings cannot work together on this machine and model."""
