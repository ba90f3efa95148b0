"""The errors npuport reports to a user: each message names the file and, where there is one, the tensor."""


class NpuportError(Exception):
    """A problem with the user's input or environment; the CLI prints it and exits non-zero."""


class CheckpointError(NpuportError):
    """A source checkpoint is missing, truncated, corrupt or not a Qwen3.5 model."""


class RecipeError(NpuportError):
    """A recipe asks for something npuport does not implement, or is malformed."""


class ArtifactError(NpuportError):
    """An artifact violates the checkpoint contract or cannot be loaded."""


class EndpointError(NpuportError):
    """An OpenAI-compatible server is unreachable, times out, or answers something unusable; names the URL."""
