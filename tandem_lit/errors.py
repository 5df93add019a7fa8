"""Errors a user can fix: each names the problem and the fix. ``tandem-lit`` prints them as one
line (set ``TANDEM_LIT_TRACEBACK=1`` for the traceback); anything else is a bug and keeps its
traceback."""


class TandemLitError(Exception):
    """Base of user-fixable errors."""

    def __str__(self) -> str:  # KeyError subclasses would otherwise print their message quoted
        return str(self.args[0]) if self.args else ""


class ConfigError(TandemLitError, ValueError):
    """A setting is out of range or contradicts another."""


class DataError(TandemLitError, KeyError):
    """Dataset rows lack a field, or a dataset cannot be found."""


class ModelSourceError(TandemLitError, OSError):
    """A model path or hub name cannot be loaded."""


class NonFiniteGradientError(TandemLitError, FloatingPointError):
    """An update's gradient is NaN or infinite: it is not applied, and the run stops."""


class LogprobGapError(TandemLitError):
    """The engine's log-probs and the training forward's disagree beyond ``update.logp_gap_limit``:
    the step's update is not applied, and the run stops."""


class MissingDependencyError(TandemLitError, ImportError):
    """An optional dependency the chosen component needs is not installed."""


class DeviceMemoryError(TandemLitError, RuntimeError):
    """The GPU ran out of memory in a phase of a step (``training.out_of_memory``): names the phase
    and the setting to lower; the last checkpoint is left as it was."""
