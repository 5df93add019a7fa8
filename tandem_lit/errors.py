"""Errors a user can fix: each names the problem and the fix. ``tandem-lit`` prints them as one
line (set ``TANDEM_LIT_TRACEBACK=1`` for the traceback); anything else is a bug and keeps its
traceback. Every such class lives here, whichever layer raises it, so that a caller finds them
in one place (the modules that raise them import them from here)."""


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


class TrainingStalledError(TandemLitError, RuntimeError):
    """Training cannot make progress with these settings (steps keep making no update)."""


class MemoryBudgetError(ConfigError):
    """The estimated peak memory of a step exceeds the device's."""


class TokenizerMismatchError(ConfigError):
    """Senior and junior tokenizers differ where a shared one is required."""


class WeightSyncError(ConfigError):
    """The named tensors do not fit the engine's rollout model."""


class AuthorshipError(TandemLitError, ValueError):
    """Authorship is missing or malformed: refuse to compute a loss (fail closed)."""


class MissingColumnError(DataError):
    """The dataset rows lack a field the verifier needs."""


class JudgeAuthError(ConfigError):
    """The judge server rejected the API key: every later request would fail the same way."""


class SandboxRefusedError(ConfigError):
    """The sandbox cannot apply a protection on this machine, and it was not allowed to be missing."""


class RunWriteError(TandemLitError, OSError):
    """A file of the run cannot be written (disk full, read only, quota): what is already saved is
    whole, and the line says which checkpoint a resume starts from (``tandem_lit.write_faults``)."""


class ProcessGroupError(TandemLitError, RuntimeError):
    """The processes of a run cannot meet (a port in use) or one of them stopped: the others stop
    with this line instead of a collective's traceback."""


class JudgeUnavailableError(ConfigError):
    """The judge server has not answered ``give_up_after`` requests in a row: it went away,
    and the run would otherwise go on without its bonus for good."""


class DeviceMemoryError(TandemLitError, RuntimeError):
    """The GPU ran out of memory in a phase of a step (``training.out_of_memory``): names the phase
    and the setting to lower; the last checkpoint is left as it was."""
