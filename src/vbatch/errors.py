"""The VbatchError hierarchy: every error a user may see, printed without a traceback."""


class VbatchError(Exception):
    """Base of every user-facing error; the CLI prints it and exits non-zero."""

    exit_code: int = 1


class ConfigError(VbatchError):
    """An engine or job setting is invalid."""


class SamplingParamsError(VbatchError):
    """A sampling parameter is missing, of the wrong type or out of range."""


class ModelLoadError(VbatchError):
    """A model file or directory cannot be found, read or understood."""


class PromptTooLongError(VbatchError):
    """A prompt does not fit the model's maximum length."""


class EngineStartupError(VbatchError):
    """The engine-core process failed before it reported READY."""


class EngineDeadError(VbatchError):
    """The engine-core process died while the client still needed it."""


class InputError(VbatchError):
    """The input file or one of its columns cannot be used."""


class JobStateError(VbatchError):
    """The job directory is missing, corrupt, or does not match this run."""
