"""User-facing error types: each message is one line saying what is wrong and what to do."""


class JaxinferError(ValueError):
    """Base class for errors caused by user input (arguments, configs, checkpoints)."""


class ConfigError(JaxinferError):
    """A model config has an unsupported or inconsistent field."""


class CheckpointError(JaxinferError):
    """A checkpoint or GGUF file is missing, corrupt, or does not match its config."""


class InputError(JaxinferError):
    """A prompt or generation request is invalid (empty, too long, bad sampling value)."""


class RequestError(RuntimeError):
    """A request failed while it ran (its output handling raised, or the device ran out of
    memory in its step); the engine and the other requests went on."""
