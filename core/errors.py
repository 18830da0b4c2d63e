"""User-facing errors.  CLIs catch `UserError` and print its message without a traceback."""


class UserError(Exception):
    """Bad input from the user: a missing folder, a wrong file, a mismatched model."""


class CorruptImageError(UserError):
    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read image {self.path}: {reason}")


class DatasetLayoutError(UserError):
    """A data-set root that lacks a file or folder its official layout has."""


class CheckpointMismatchError(UserError):
    """A checkpoint for another architecture, dimension or model."""
