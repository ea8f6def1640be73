"""The one exception type of the data pipeline.

Every problem with a user's data (a missing or corrupted ``.idx``/``.bin`` pair, a bad JSON line, a
split that cannot provide the samples asked of it) raises :class:`DataError` with a message that names
the file and, where there is one, the line or byte offset. Callers that want to tell data problems apart
from programming errors catch this type.
"""

from __future__ import annotations


class DataError(ValueError):
    """Unusable input data. The message names the file and the line or byte offset involved."""
