"""How an update's rows are cut into forward/backward passes bounded by tokens.

``UpdatePhase.passes`` bounds a pass by rows (``update.micro_batch_size``) and, with
``memory.micro_batch_tokens``, by tokens: ``pack_by_tokens`` groups rows so that each pass stays
under the token bound, padded (rows of like length together) or packed (sequences end to end).
"""

from __future__ import annotations


def pack_by_tokens(
    prompts: list[int], completions: list[int], max_rows: int, max_tokens: int, packed: bool = False,
) -> list[list[int]]:
    """Row indices in passes of at most ``max_rows`` rows and ``max_tokens`` tokens, longest first.

    Padded rows (``packed`` False): a pass costs its rows x (longest prompt + longest completion),
    so rows of like length share a pass. Packed rows: a pass costs the sum of its sequences'
    tokens, and each row goes into the first pass with room for it (first-fit decreasing). A row
    longer than ``max_tokens`` goes alone."""
    order = sorted(range(len(prompts)), key=lambda i: -(prompts[i] + completions[i]))
    passes: list[list[int]] = []
    if packed:
        used: list[int] = []
        for i in order:
            tokens = prompts[i] + completions[i]
            room = next((k for k, p in enumerate(passes) if len(p) < max_rows and used[k] + tokens <= max_tokens), None)
            if room is None:
                passes.append([i])
                used.append(tokens)
            else:
                passes[room].append(i)
                used[room] += tokens
        return passes
    for i in order:
        current = passes[-1] if passes else []
        grown = current + [i]
        # a trimmed pass is as wide as its longest prompt plus its longest completion
        padded = len(grown) * (max(prompts[j] for j in grown) + max(completions[j] for j in grown))
        if current and len(grown) <= max_rows and padded <= max_tokens:
            current.append(i)
        else:
            passes.append([i])
    return passes
