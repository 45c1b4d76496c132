"""User-facing errors. The CLI prints these as one line and exits non-zero; anything else is a
bug."""


class DlrmError(Exception):
    """Base class of every error whose message is meant for the user."""


class ConfigError(DlrmError):
    """A configuration file, flag or value is invalid."""


class DataError(DlrmError):
    """An input data file is missing or malformed (the message names file and line)."""


class CheckpointError(DlrmError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""
