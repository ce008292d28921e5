"""Exit statuses of ``twistd logbroker`` and the ``logbroker`` command (see docs/operations.md)."""

#: Success; for ``logbroker storage verify``: every segment verified.
OK = 0
#: A runtime failure; for ``logbroker storage verify``: damage was found.
FAILURE = 1
#: Bad usage or configuration: the message names the variable or option and the bad value.
CONFIG_ERROR = 2
#: The data directory was written by a newer storage format than this build reads.
FORMAT_TOO_NEW = 3
