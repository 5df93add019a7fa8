"""The memory plan against what a step really holds, at the one-GPU configs' shapes, on a GPU.

``tandem-lit fit`` on ``configs/rlvr/qwen3_4b_tandem_lora_h100.yaml`` and
``configs/rlvr/qwen35_9b_2b_tandem_lora.yaml`` as written but for their paths and the response cap:
random-weight folders of their models' shapes with the real tokenizer (scripts/random_hf_folder.py),
16 prompts x 8 rollouts, the KV pool sized by ``kv_cache_gib: auto``. The cap is 512 tokens to keep
the test short: the pool is allocated whole however long the rollouts, and the update's passes are
filled to ``memory.micro_batch_tokens`` (``fill_passes``), so both phases meet the sizes the plan
counts. The run logs each phase's peak (torch's allocator, reset as the phase starts) beside the
plan's figure for it (less the plan's fixed overhead, which the allocator does not see).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, load_script

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("in_repo")]

# the real Qwen3 tokenizer: beside the checkout on a developer's machine, unpacked into .gpu/ on a
# GPU machine (dev/gpu_call.sh)
TOKENIZERS = (REPO_ROOT.parent / "shared/models/qwen3-tokenizer", REPO_ROOT / ".gpu/qwen3-tokenizer")
# how far above a phase's measured peak its plan may be: the plan errs high by design (an estimate
# that errs low ends a run out of memory), but not by so much that it refuses runs that fit
MOST_OVER = 1.5


def tokenizer_folder() -> Path:
    for folder in TOKENIZERS:
        if (folder / "tokenizer.json").is_file():
            return folder
    pytest.skip(f"needs the Qwen3 tokenizer in one of {', '.join(map(str, TOKENIZERS))}")


# the one-GPU LoRA configs, each with the hub models it pairs (folders of their shapes)
ONE_GPU_CONFIGS = {
    "configs/rlvr/qwen3_4b_tandem_lora_h100.yaml": ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B-Instruct-2507"),
    # its first fit on an H100 ran out of memory in the update (docs/performance.md): this checks the
    # smaller passes it has had since against the plan
    "configs/rlvr/qwen35_9b_2b_tandem_lora.yaml": ("Qwen/Qwen3.5-9B", "Qwen/Qwen3.5-2B"),
}


def random_folder(hub_name: str, out: Path) -> Path:
    return load_script("random_hf_folder").write_folder(hub_name, tokenizer_folder(), out, device="cuda")


@pytest.mark.parametrize("config", sorted(ONE_GPU_CONFIGS))
def test_each_phase_peak_is_under_its_plan_at_the_one_gpu_configs_shapes(tmp_path, config):
    from tandem_lit.cli import main

    if torch.cuda.get_device_properties(0).total_memory < 75 * 1024**3:
        pytest.skip("the one-GPU LoRA configs plan for an 80 GB card")
    folders = {name: random_folder(name, tmp_path / "models") for name in dict.fromkeys(ONE_GPU_CONFIGS[config])}
    senior, junior = (folders[name] for name in ONE_GPU_CONFIGS[config])  # (the 4B pairs one folder with itself)
    problems = tmp_path / "train.json"
    problems.write_text(json.dumps([{"problem": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(40)]))
    root = tmp_path / "run"
    main(args=[
        "fit", "--config", config,
        "--model.init_args.senior.path", str(senior), "--model.init_args.junior.path", str(junior),
        "--data.init_args.source", str(problems), "--data.init_args.val_size", "2",
        "--model.init_args.rollout.sampling.max_new_tokens", "512",
        "--model.init_args.evaluation.at_start", "false", "--trainer.limit_val_batches", "0",
        "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
    ])
    rows = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    (row,) = [row for row in rows if "train/rollout_peak_memory_gb" in row]
    for phase in ("rollout", "update"):
        peak, plan = row[f"train/{phase}_peak_memory_gb"], row[f"train/{phase}_memory_plan_gb"]
        assert peak <= plan, f"the {phase} held {peak:.1f} GiB, more than its plan's {plan:.1f}"
        assert plan <= MOST_OVER * peak, f"the {phase}'s plan, {plan:.1f} GiB, is far above its peak, {peak:.1f}"
