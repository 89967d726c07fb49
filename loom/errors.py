"""User-facing errors: one line saying what is wrong and how to fix it, never a traceback."""


class LoomError(Exception):
    """A problem the user can fix; the CLI prints its message alone and exits non-zero."""


class ConfigError(LoomError):
    """A bad configuration value, found before any process group starts."""


class AgreedError(LoomError):
    """An error every rank raises at the same point (the ranks agreed on it): the launcher reports
    it once, as one line, instead of as a failed rank."""
