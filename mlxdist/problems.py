"""The one exception a user sees as one line: its own module, below everything else, so the
config schema and the gate for files from elsewhere can both raise it without importing each
other."""


class ConfigError(ValueError):
    """A one-line, user-facing problem: a config key, a file from elsewhere, a command's input.
    The message names the file, key, host or rank and says what to do."""
