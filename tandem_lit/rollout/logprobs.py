"""Teacher-forced log-probs of completion tokens, without materialising [N, T, V] float logits.

A 3,000-token completion over a 150k vocabulary is 1.8 GB of float logits per sequence. The
backbone runs once; the vocabulary projection, temperature and log-softmax run in chunks of
positions, each recomputed in the backward pass (activation checkpointing), so peak memory is
one chunk however long the completion.

Packed (``packed=True``): the rows' real tokens (prompt + completion, no padding) are concatenated
into one row with position ids restarting at 0 per sequence and no attention mask. transformers
reads the restarts as document boundaries (``masking_utils.find_packed_sequence_indices``: a
block-diagonal causal mask for sdpa / eager / flex attention; varlen kernels for flash attention,
which needs the single row), so each sequence attends only to itself, as in the padded rows, and
no compute or logits are spent on padding. During the update an ``sdpa`` model runs
``models.varlen_attention`` instead, handed each sequence's bounds: PyTorch's variable-length flash
kernel on CUDA, no mask built. Models whose linear-attention layers carry state along
the row (Qwen3.5's Gated DeltaNet) and attention kernels that ignore the restarts are refused.

Fused (``fused=True``, ``memory.fused_kernels``): Liger-Kernel's fused linear cross-entropy in
place of the chunks (``models.liger.liger_logprobs``): the same log-probs to bf16 rounding.

Switches (``rollout.switch``): where the rollout's codes say a token was drawn from a restricted
set, or the senior's span ended at a boundary, the log-masses of those sets are added, as the
engine recorded them, in every layout above; only those positions are projected again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tandem_lit.errors import ConfigError
from tandem_lit.models.delta_scan import chunk_gated_delta_rule
from tandem_lit.models.liger import liger_logprobs
from tandem_lit.models.varlen_attention import VARLEN, uses_varlen
from tandem_lit.rollout.record import Rollout
from tandem_lit.rollout.switch import set_log_mass
from tandem_lit.rollout.weights import plain_model

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 2**28  # float logits per chunk (1 GiB)
# where float32_delta_rule runs the delta rule's chunk loop as Triton kernels (models.delta_scan).
# CUDA: the compiled rule equals transformers' at the 9B's shape (tests/test_delta_scan.py) and a
# layer's forward + backward is faster than the float32 torch loop's (dev/benchmarks/delta_rule_cost.py,
# dev/log.md). The CPU keeps transformers' torch loop (a launch costs nothing there).
TRITON_SCAN_DEVICES: frozenset[str] = frozenset({"cuda"})
# attention implementations that turn restarting position ids into document-masked attention
# (transformers 5: the mask functions of masking_utils, and flash attention's varlen path)
PACKED_ATTENTION = frozenset({VARLEN, "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"})


def avoid_cudnn_attention_backward() -> None:
    """Route scaled-dot-product attention away from the cuDNN backend for training on CUDA.

    On H100/H200 with torch 2.11, cuDNN's SDPA backward returns NaN query gradients when an
    attention mask is passed and the length is 64 mod 128 (pytorch/pytorch#196678): our training
    forward passed a padding mask then (packed rows still get a document mask), and a tiny
    bf16-mixed run got NaN weights after its first update. Flash / memory-efficient / math
    attention are exact on the same inputs. Set process-wide (not a context manager) because
    activation checkpointing re-runs the forward inside backward, outside any context around the
    forward.
    """
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention disabled for training (NaN gradients with padding masks: pytorch#196678)")


@contextlib.contextmanager
def engine_matched_precision(model: nn.Module) -> Iterator[None]:
    """The training forward's mixed precision where it would part from FastEngine's bf16 decode
    for no reason: the embeddings as the engine reads them, and Qwen3.5's delta rule in float32
    as the engine runs its recurrence (issue 26: the rollout-vs-train log-prob gap)."""
    if has_linear_attention(model):
        float32_delta_rule()
    with embeddings_at_compute_precision(model):
        yield


@contextlib.contextmanager
def embeddings_at_compute_precision(model: nn.Module) -> Iterator[None]:
    """Under low-precision autocast, the input embeddings rounded to its dtype (and kept float32).

    Autocast rounds every weight a matmul reads to bf16, but an embedding lookup is no matmul: the
    training forward would read the float32 master rows while the engine decodes from its bf16
    copy's. On a random Qwen3.5-9B shape that one difference is a fifth of the rollout-vs-train
    log-prob gap (dev/benchmarks/logp_gap.py); FSDP2's bf16 compute gathers the rows in bf16
    anyway. The residual stream stays float32, as autocast keeps it."""

    def rounded(module, args, out: Tensor) -> Tensor | None:
        device = out.device.type
        if out.dtype == torch.float32 and torch.is_autocast_enabled(device):
            return out.to(torch.get_autocast_dtype(device)).float()
        return None

    handle = plain_model(model).get_input_embeddings().register_forward_hook(rounded)
    try:
        yield
    finally:
        handle.remove()


def float32_delta_rule() -> None:
    """Run transformers' chunked gated delta rule (Qwen3.5's linear attention, torch path) with
    autocast off, in every process that trains such a model; idempotent.

    The rule casts its inputs to float32 itself, but under bf16 autocast each of its matmuls
    rounds to bf16 again, while FastEngine's recurrence runs in float32 (its state, decay and
    delta update): the two sides then drift apart layer after layer. With the embeddings matched
    too (``embeddings_at_compute_precision``) this halves the engine-vs-train gap of a random
    32-layer Qwen3.5 (dev/benchmarks/logp_gap.py). Process-wide, not a context: activation
    checkpointing recomputes the forward inside backward, which must compute what the forward did.
    Under no autocast (the engine's prefill, float32 training) it changes nothing on the CPU.

    On the devices in ``TRITON_SCAN_DEVICES`` (CUDA), the
    patched rule is ``models.delta_scan.chunk_gated_delta_rule``: the same float32 rule with its
    chunk loop as two Triton kernels instead of thousands of small launches per layer (issue 26),
    unless flash-linear-attention is installed, which transformers' rule then runs.
    Qwen3.5's layers look the rule up in their module at each call, so models built before the
    patch run it too."""
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35
    except ImportError:  # a transformers without Qwen3.5
        return
    rule = qwen35.torch_chunk_gated_delta_rule
    if getattr(rule, "autocast_off", False):
        return

    fla = importlib.util.find_spec("fla") is not None  # transformers' rule is then fla's kernels, not the torch loop

    @functools.wraps(rule)
    def rule_without_autocast(query: Tensor, *args, **kwargs):
        scan = chunk_gated_delta_rule if query.device.type in TRITON_SCAN_DEVICES and not fla else rule
        with torch.autocast(query.device.type, enabled=False):
            return scan(query, *args, **kwargs)

    rule_without_autocast.autocast_off = True
    qwen35.torch_chunk_gated_delta_rule = rule_without_autocast


def has_linear_attention(model: nn.Module) -> bool:
    return "linear_attention" in (getattr(plain_model(model).config, "layer_types", None) or [])


def last_hidden_state(model: nn.Module, **inputs) -> Tensor:
    """The backbone's last hidden state (no vocabulary projection)."""
    return plain_model(model).base_model(**inputs).last_hidden_state


def completion_hidden_states(model: nn.Module, rollout: Rollout) -> Tensor:  # -> [N, T, H]
    """The backbone's hidden states at the positions that predict each completion token.

    Every row is re-laid left-aligned (its real prompt tokens, its completion, padding at the
    right end) and runs with no attention mask and positions 0, 1, 2, ... Under a causal model a
    real token then sees only real tokens of its own row, as with the left-padded prompt and a
    padding mask, and Qwen3.5's linear-attention layers (recurrence and causal conv, which only
    look back) need no mask either. Why: a padding mask takes scaled-dot-product attention off its
    flash kernel, and the attention backward of unequal rows took several times that of equal
    rows of the same tokens without a mask (dev/log.md). Assumes every prompt has a token and
    completions are right-padded (``Rollout``); the hidden states at padding positions are some
    value, which callers mask. Rows are ``prompt_width + width`` positions wide, which is the
    longest row's length when the rollout is ``trimmed`` (as the update's passes are): the width
    is known without reading the lengths back from the device, a sync per pass.
    """
    prompt, completion = rollout.prompt_ids, rollout.completion_ids
    prompt_width, width = prompt.shape[1], completion.shape[1]
    prompt_lengths = rollout.prompt_mask.sum(-1)  # [N]
    row_width = prompt_width + width
    steps = torch.arange(row_width, device=prompt.device)
    # left-aligned position k of row i holds column first_i + k of [prompt | completion], first_i
    # its first real prompt column: its real prompt, then its completion; past the end (clamped)
    # only padding, which no real token sees
    columns = (prompt_width - prompt_lengths)[:, None] + steps
    ids = torch.cat([prompt, completion], dim=1).gather(1, columns.clamp_max(prompt_width + width - 1))
    # (FSDP: ``shard_model`` registers this as a forward of the root unit, so that its shards,
    # embeddings and head, are gathered for it and their gradients reduced after backward)
    forward = getattr(model, "completion_hidden", None) or functools.partial(last_hidden_state, model)
    with engine_matched_precision(model):
        hidden = forward(input_ids=ids, attention_mask=None, position_ids=steps.expand_as(ids))
    # completion token j of row i is predicted at position prompt_length_i - 1 + j
    predictors = prompt_lengths[:, None] - 1 + steps[:width]
    return hidden.take_along_dim(predictors.unsqueeze(-1), dim=1)


def check_packable(model: nn.Module) -> None:
    """Fail with one line when packed rows would let sequences see each other in ``model``."""
    config = plain_model(model).config
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKED_ATTENTION:
        raise ConfigError(
            f"memory.pack_sequences needs an attention implementation that separates packed sequences "
            f"({', '.join(sorted(PACKED_ATTENTION))}); this model uses {attention!r}: set pack_sequences: false"
        )
    if has_linear_attention(model):
        raise ConfigError(
            "memory.pack_sequences: this model has linear-attention layers (Gated DeltaNet), whose state "
            "would run from one packed sequence into the next: set pack_sequences: false"
        )


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Where each row's real tokens (its prompt, then its completion) sit in one packed row, built
    on the host from the rows' lengths, so that packing reads nothing back from the device.

    ``gather``: [L] flat indices into the rows' ``[prompt | completion]`` columns; ``positions``: [L],
    restarting at 0 per sequence; ``predictors``: [C] the packed position whose hidden state
    predicts each written completion token (row by row); ``written``: [C] those tokens' flat
    indices into ``completion_ids``, and ``written_host`` the same on the host; ``bounds``: [N + 1]
    int32 cumulative sequence lengths."""

    gather: Tensor
    positions: Tensor
    predictors: Tensor
    written: Tensor
    bounds: Tensor
    longest: int
    written_host: Tensor

    @classmethod
    def of(cls, rollout: Rollout, lengths: tuple[list[int], list[int]] | None = None) -> PackedRows:
        """``lengths``: each row's prompt and completion lengths (None: read from the device, once)."""
        if lengths is None:
            lengths = rollout.prompt_mask.sum(-1).tolist(), rollout.lengths.tolist()
        prompt_width, width = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
        gather, positions, predictors, written, bounds = [], [], [], [], [0]
        for i, (prompt, completion) in enumerate(zip(*lengths)):
            row = i * (prompt_width + width)
            gather.extend(range(row + prompt_width - prompt, row + prompt_width + completion))
            positions.extend(range(prompt + completion))
            predictors.extend(range(bounds[-1] + prompt - 1, bounds[-1] + prompt - 1 + completion))
            written.extend(range(i * width, i * width + completion))
            bounds.append(bounds[-1] + prompt + completion)
        device = rollout.completion_ids.device
        longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
        tensors = [to_device(torch.tensor(v, dtype=torch.long), device) for v in (gather, positions, predictors, written)]
        return cls(*tensors, to_device(torch.tensor(bounds, dtype=torch.int32), device), longest,
                   torch.tensor(written, dtype=torch.long))


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without waiting for the stream (a pinned copy on CUDA)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def packed_hidden_states(model: nn.Module, rollout: Rollout, rows: PackedRows) -> Tensor:  # -> [C, H]
    """The backbone's hidden states that predict each written completion token (C of them, row by
    row), from one packed row of all sequences laid out as ``rows`` says."""
    check_packable(model)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1).reshape(-1)[rows.gather]
    forward = getattr(model, "completion_hidden", None) or functools.partial(last_hidden_state, model)
    boundaries = {}
    if uses_varlen(plain_model(model)):  # the sequences' bounds for the variable-length kernel (models.varlen_attention)
        boundaries = dict(cu_seq_lens_q=rows.bounds, cu_seq_lens_k=rows.bounds, max_length_q=rows.longest,
                          max_length_k=rows.longest)
    # no cache: transformers reads restarting position ids as packed sequences only without one
    # (masking_utils._preprocess_mask_arguments), and config.use_cache would make one
    with engine_matched_precision(model):
        hidden = forward(input_ids=ids.unsqueeze(0), position_ids=rows.positions.unsqueeze(0), use_cache=False,
                         **boundaries)
    return hidden[0, rows.predictors]


def completion_logprobs(
    model: nn.Module, rollout: Rollout, temperature: float, packed: bool = False, fused: bool = False,
    vocab: int | None = None, lengths: tuple[list[int], list[int]] | None = None,
) -> Tensor:  # -> [N, T]
    """log p(token_t | prompt, tokens_<t) of every completion token, logits divided by
    ``temperature`` (if > 0). Padding positions get some value (0 when ``packed``); callers mask
    them. ``packed``: one forward over the concatenated sequences; ``fused``: Liger's fused head
    (module docstring). ``vocab``: normalise over the head's first ``vocab`` logits only, the
    tokens the engine samples from (``RolloutEngine.sampled_vocab``); None: all of them.
    ``lengths``: with ``packed``, each row's prompt and completion lengths as the host knows them
    (None: read once from the device)."""
    causal_lm = plain_model(model)
    head = causal_lm.get_output_embeddings()
    kept = None if vocab is None or vocab >= head.weight.shape[0] else vocab
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    completion = rollout.completion_ids
    if packed:  # the written tokens as one row: no logits for padding either
        rows = PackedRows.of(rollout, lengths)
        hidden = packed_hidden_states(model, rollout, rows).unsqueeze(0)
        completion = completion.reshape(-1)[rows.written].unsqueeze(0)

        def unpacked(logp: Tensor) -> Tensor:  # [1, C] -> [N, T], 0 at padding
            return logp.new_zeros(rollout.completion_ids.numel()).index_copy(0, rows.written, logp[0]).view_as(rollout.completion_ids)
    else:
        hidden = completion_hidden_states(model, rollout)
    width = completion.shape[1]

    def normalised(h: Tensor) -> Tensor:  # hidden states -> log-softmax at the temperature
        logits = head(h)[..., :kept].float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature > 0:
            logits = logits / temperature
        return logits.log_softmax(-1)

    codes = None
    if rollout.token_sets is not None:  # the switches' codes (host tensors), in the layout of ``completion``
        codes = [rollout.start_set.cpu(), rollout.end_set.cpu()]
        if packed:
            codes = [c.reshape(-1)[rows.written_host].unsqueeze(0) for c in codes]

    def with_switches(logp: Tensor) -> Tensor:
        if codes is not None:
            logp = logp + switch_terms(normalised, hidden, *codes, rollout.token_sets, head.weight.shape[0])
        return unpacked(logp) if packed else logp

    if fused:
        return with_switches(liger_logprobs(hidden, head.weight, completion, temperature, CHUNK_ELEMENTS, vocab=kept))

    def chunk_logprobs(h: Tensor, targets: Tensor) -> Tensor:
        return normalised(h).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    step = max(1, CHUNK_ELEMENTS // (completion.shape[0] * head.weight.shape[0]))
    parts = []
    for start in range(0, width, step):
        h, targets = hidden[:, start : start + step], completion[:, start : start + step]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(chunk_logprobs, h, targets, use_reentrant=False))
        else:
            parts.append(chunk_logprobs(h, targets))
    logp = torch.cat(parts, dim=1) if parts else hidden.new_zeros(completion.shape, dtype=torch.float32)
    return with_switches(logp)


def switch_terms(normalised, hidden: Tensor, start: Tensor, end: Tensor, sets: Tensor, head_rows: int) -> Tensor:
    """What a switch adds to each token's log-prob (``rollout.switch``): ``-log Z`` of its start set
    at its own position, and ``log Z`` of the end set at the next position (the senior's span
    ended there). ``normalised``: hidden states -> log-softmax; ``hidden`` [N, T, H]; codes [N, T];
    only the coded positions are projected (in chunks, recomputed in backward). The codes are host
    tensors (``Rollout.start_set``): the positions are found there, so nothing waits for the device.
    # -> [N, T]"""
    coded = ((start != 0) | (end != 0)).numpy()
    host_where = np.nonzero(coded)  # (numpy: on the host, no device op)
    terms = hidden.new_zeros((2, *coded.shape), dtype=torch.float32)
    if not host_where[0].size:
        return terms[0]
    where = tuple(to_device(torch.from_numpy(w).long(), hidden.device) for w in host_where)
    host_index = tuple(torch.from_numpy(w).long() for w in host_where)
    at = hidden[where]
    start_codes, end_codes = (to_device(c[host_index], hidden.device) for c in (start, end))
    sets = sets.to(hidden.device)

    def masses(h: Tensor, s: Tensor, e: Tensor) -> Tensor:  # -> [2, n]: start and end set log-masses
        logp = normalised(h)
        return torch.stack([set_log_mass(logp, sets, s), set_log_mass(logp, sets, e)])

    step = max(1, CHUNK_ELEMENTS // head_rows)
    parts = []
    for first in range(0, at.shape[0], step):
        chunk = (at[first : first + step], start_codes[first : first + step], end_codes[first : first + step])
        if torch.is_grad_enabled() and at.requires_grad:
            parts.append(checkpoint(masses, *chunk, use_reentrant=False))
        else:
            parts.append(masses(*chunk))
    start_mass, end_mass = torch.cat(parts, dim=1)
    terms = terms.index_put((torch.zeros_like(where[0]), *where), -start_mass)
    terms = terms.index_put((torch.ones_like(where[0]), *where), end_mass)
    # the senior's span end is scored on its last token, the one before (never a row's first)
    return terms[0] + torch.nn.functional.pad(terms[1][:, 1:], (0, 1))


@torch.no_grad()
def completion_top_tokens(model: nn.Module, rollout: Rollout, vocab: int | None = None) -> Tensor:  # -> [N, T] long
    """The model's most likely token at every completion position, teacher-forced on the
    completion (what it would have written next after each prefix), among the head's first
    ``vocab`` tokens (None: all)."""
    head = plain_model(model).get_output_embeddings()
    hidden = completion_hidden_states(model, rollout)
    step = max(1, CHUNK_ELEMENTS // (hidden.shape[0] * head.weight.shape[0]))
    return torch.cat([head(hidden[:, s : s + step])[..., :vocab].argmax(-1) for s in range(0, hidden.shape[1], step)], dim=1)
