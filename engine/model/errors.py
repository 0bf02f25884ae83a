"""Errors a user can act on when a checkpoint cannot be served."""


class CheckpointError(ValueError):
    """The directory is not a supported checkpoint; the message names the file and key."""
