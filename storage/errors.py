"""Storage exceptions, kept in one place so callers can catch a single base."""

from __future__ import annotations


class StorageError(Exception):
    """Anything the storage layer refuses or cannot do, with a readable reason."""


class FieldError(StorageError, ValueError):
    """A value refused before it reaches SQL; ``field`` names it and so does the message."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class CorruptBlobError(StorageError):
    """A stored model blob no longer matches the checksum recorded at write time."""

    def __init__(self, version_id: int | None, expected: str, actual: str) -> None:
        self.version_id = version_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"predictor version {version_id}: blob sha256 mismatch "
            f"(recorded {expected}, computed {actual}); refusing to load a corrupt model"
        )
