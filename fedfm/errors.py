"""Errors raised by fedfm.

Every error a user can cause derives from :class:`FedfmError`; the command line prints its
message on one line and exits non-zero instead of showing a traceback.
"""

from __future__ import annotations


class FedfmError(Exception):
    """Base class of every error fedfm raises on purpose."""


class ConfigError(FedfmError):
    """A setting, argument or configuration value is invalid."""


class DataError(FedfmError):
    """A dataset is missing, malformed or cannot be partitioned as asked."""


class ModelError(FedfmError):
    """A model name, checkpoint or architecture cannot be used."""


class CheckpointError(ModelError):
    """A checkpoint file is corrupt or does not match the model or run it is loaded into."""


class ApproximationDomainError(FedfmError):
    """An approximation was evaluated outside the input range it is valid on."""


class ProtocolError(FedfmError):
    """A protocol message arrived in a state that does not allow it, or is malformed."""


class ProtocolAbort(ProtocolError):
    """A refusal after which the refusing party leaves the run.

    A refused request normally changes nothing on the node that refuses it. A refusal that follows
    a decryption is different: whether a party refuses can itself tell the sender something (an
    oracle), so the party closes the door instead of answering again. ``state`` is the role's
    new state (whatever the role's state type is), which the node saves before it reports the
    refusal.
    """

    def __init__(self, message: str, state: object) -> None:
        super().__init__(message)
        self.state = state


class InvariantError(Exception):
    """An internal invariant broke: a bug in fedfm, not a problem with the caller's input.

    Deliberately not a :class:`FedfmError`: the command line shows its traceback, a ClientApp
    does not turn it into a polite refusal, and ``python -O`` does not strip the check (as it
    would an ``assert``).
    """


class CryptoParameterError(FedfmError):
    """Encryption parameters are insecure or cannot support the requested computation."""
