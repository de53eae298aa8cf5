"""Where the engine takes snapshots.

Full-attention KV can be truncated to any earlier length, so for an all-full-attention family the
end-of-generation snapshot serves every later prefix. Any other layer (sliding ring, chunked,
recurrent) can only be restored near the length it was taken at, so those families snapshot at
each message boundary during prefill too: an edited or regenerated turn then restores the last
boundary before the change instead of prefilling the whole conversation again.
"""

from __future__ import annotations

from ..cache.specs import CacheSpec, all_trimmable


def wants_prompt_end_snapshot(specs: list[CacheSpec]) -> bool:
    return not all_trimmable(specs)


def checkpoint_positions(specs: list[CacheSpec], boundaries: list[int], start: int, prompt_len: int) -> list[int]:
    """Sorted positions in ``(start, prompt_len]`` to snapshot at while prefilling
    ``tokens[start:prompt_len]``; ``boundaries`` are the token offsets where messages end."""
    if all_trimmable(specs) or prompt_len <= start:
        return []
    points = {b for b in boundaries if start < b <= prompt_len}
    points.add(prompt_len)
    return sorted(points)
