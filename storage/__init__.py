"""SQL persistence for HVD predictor versions and the aliases pointing at them.

Deliberately independent of the controller/predictor packages so it can be
migrated and inspected without importing any ML code.
"""

from storage.errors import CorruptBlobError, FieldError, StorageError

__all__ = ["CorruptBlobError", "FieldError", "StorageError"]
