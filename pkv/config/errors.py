"""The one exception of a config that must not run (re-exported by pkv.config.resolve)."""


class ConfigError(ValueError):
    """A configuration that must not run; the message is one line naming the key."""
