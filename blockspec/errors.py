"""User-facing errors: each message says what is wrong and how to fix it."""


class BlockspecError(ValueError):
    """A problem with the user's input (paths, models, options, data).

    The CLI prints these as one line, without a traceback.
    """


class CheckpointError(BlockspecError):
    """A checkpoint directory is missing files, or holds files that do not parse."""


class IncompatibleDraftError(BlockspecError):
    """A drafter does not fit the target it is asked to draft for."""
