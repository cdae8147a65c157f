"""The app's error for bad settings, in a module of its own so that every layer can raise it."""


class ConfigError(ValueError):
    """A setting that composes but cannot run; the message is one line with the numbers."""
