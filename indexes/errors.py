"""What the fleet index raises on bad input (the proxy maps each family to one answer).

```
ValueError
 └── FleetIndexError            anything indexes/ refuses
      ├── VectorError            wrong shape, non-finite or not L2-normalised vectors
      ├── UnsupportedFilterError a LlamaIndex metadata filter the store cannot evaluate
      └── SnapshotError          a snapshot that is unreadable, inconsistent or of another dim
KeyError                         update_driver on an unknown driver
features.constraints.UnknownConstraintError (ValueError)   unknown constraint in recommend
RuntimeError
 └── ChangeLogError              the change log cannot be written, or holds a change this
                                 version cannot read (not bad input: the server's fault)
```
"""

from __future__ import annotations


class FleetIndexError(ValueError):
    """Base of the errors the fleet index raises on bad input."""


class VectorError(FleetIndexError):
    """Vectors of the wrong shape, non-finite, or not unit length."""


class UnsupportedFilterError(FleetIndexError):
    """A metadata filter (key, operator or condition) the store cannot evaluate."""


class SnapshotError(FleetIndexError):
    """A snapshot that cannot be loaded (corrupt, inconsistent, or another dimension)."""


class ChangeLogError(RuntimeError):
    """The fleet change log failed a write (every later change fails too, until the owner
    restarts and recovers from disk), or holds a change that cannot be read back."""
