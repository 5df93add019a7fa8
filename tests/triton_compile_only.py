"""Compile the Triton kernels for a GPU on a machine without one: what a kernel costs in registers
and whether it spills, read before any GPU time is spent.

``compiling_for(arch)`` stands in for Triton's CUDA driver (target ``sm_<arch>``) and turns every
launch into a compile-only warm-up, so the engine's own wrappers (``kernels.rope_attention``...)
can be called with CPU tensors of the real shapes: each kernel they launch is compiled to a cubin
with the ptxas Triton ships, exactly as on the GPU, and nothing runs. ``resource_usage`` reads a
compiled kernel's registers, stack and local memory (spills) with the cuobjdump Triton ships.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import jit
from triton.runtime.driver import driver

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def available() -> bool:
    return (TOOLS / "ptxas").is_file() and (TOOLS / "cuobjdump").is_file()


class _CompileOnlyDriver:
    """What a kernel's first launch asks the driver for: the target, a device and a stream."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(arch: int = 90) -> Iterator[list[tuple[str, object]]]:
    """Inside: every kernel launch compiles for ``sm_<arch>`` and launches nothing; yields the list
    of (kernel name, compiled kernel) it fills."""
    compiled: list[tuple[str, object]] = []
    launch = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only
    driver.set_active(_CompileOnlyDriver(arch))
    try:
        yield compiled
    finally:
        jit.JITFunction.run = launch
        driver._active = None  # back to the machine's own driver (or none), as before


def resource_usage(kernel) -> dict[str, int]:
    """{'REG': registers a thread, 'STACK': bytes, 'LOCAL': bytes (spills), 'SHARED': bytes} of a
    compiled kernel, from its cubin."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                             text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", line)}
