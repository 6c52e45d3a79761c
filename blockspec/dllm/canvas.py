"""A diffusion answer while it is denoised: what of it is committed, and how it looks."""

from __future__ import annotations

#: How a still-masked position is shown.
MASK_GLYPH = "░"


def committed_prefix(canvas: list[int], mask_id: int, stop_ids) -> list[int]:
    """The answer's leading tokens that are committed (up to and without a stop token)."""
    prefix = []
    for token in canvas:
        if token == mask_id or token in stop_ids:
            break
        prefix.append(token)
    return prefix


def committed_text(tokenizer, canvas: list[int], mask_id: int, stop_ids) -> str:
    """The text of the answer's committed leading tokens."""
    return tokenizer.decode(committed_prefix(canvas, mask_id, stop_ids), skip_special_tokens=True)


def render_canvas(tokenizer, canvas: list[int], mask_id: int) -> str:
    """The whole answer on one line, masked positions as ``MASK_GLYPH`` and newlines as ⏎."""
    return "".join(MASK_GLYPH if token == mask_id else tokenizer.decode([token]) for token in canvas).replace("\n", "⏎")
