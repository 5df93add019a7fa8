"""Run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before the kernels are defined):
what the interpreter needs to run the decode kernels.

An older interpreter holds a scalar loaded from memory as a 1-element array, which numpy 2 will
not ``int()`` (Triton 3.9's does not need this; the dev extra allows 3.2 up); the attention kernels
bound their loops by such a scalar (each row's length, read on the device), so the interpreter's
tensors get an ``__index__`` that reads it.
"""

from __future__ import annotations

import numpy as np
import triton.runtime.interpreter as interpreter

_patch_tensor = interpreter._patch_lang_tensor


def _patched(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patched
