"""Every Triton kernel the engine launches, compiled for sm_90 (H100, H200) without a GPU, at the
shipped configs' shapes (tests/kernels_compiled.py, in a fresh process: it stands in for the CUDA
driver). The interpreter checks the kernels' arithmetic; only the compiler says whether a kernel
compiles for the card at all, and whether it spills registers to memory (what made the delta-rule
step 1.5x slower at 8 warps: dev/log.md). A spill shows as stack or local memory in its cubin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("triton", reason="the Triton kernels need the triton package (dev extra, Linux)")

ENGINE_KERNELS = {"_rope_attention_kernel", "_merge_splits_kernel", "_gated_attention_kernel", "_conv_silu_kernel",
                  "_delta_rule_kernel", "_add_rms_norm_kernel", "_silu_mul_kernel", "_sample_kernel",
                  "_token_logprob_kernel", "_catch_up_kernel"}


def test_every_engine_kernel_compiles_for_sm90_without_spilling():
    from tests import triton_compile_only

    if not triton_compile_only.available():
        pytest.skip("needs the ptxas and cuobjdump that Triton's NVIDIA backend ships")
    done = subprocess.run([sys.executable, "-m", "tests.kernels_compiled"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert "ok" in lines
    usage = [line.split() for line in lines if line.startswith("_")]
    assert {parts[0] for parts in usage} == ENGINE_KERNELS
    for name, *fields in usage:
        found = dict(field.split(":") for field in fields)
        assert found["STACK"] == "0" and found["LOCAL"] == "0", f"{name} spills: {' '.join(fields)}"
