"""Prompt embeddings (`prompt_embeds`, vLLM's `--enable-prompt-embeds`): base64 of a `torch.save`d tensor
of shape [seq_len, hidden_size] or [1, seq_len, hidden_size] that the engine feeds the model instead of
the embeddings of token ids.

`load` checks one the same way in the frontend (a 400 before any worker sees it) and in the vLLM worker
(a second line of defence): a bad tensor is refused with a message naming `prompt_embeds`, never a
crash. torch is imported only when a request carries prompt embeddings: a frontend starts without it.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Room for what torch.save writes around the values (zip entries, the pickled tensor record): a few KB.
CONTAINER_BYTES = 64 * 1024
DTYPES = ("float32", "float16", "bfloat16")
# torch's reason for an unreadable payload is built from the client's bytes: only this much is repeated.
_REASON_CHARS = 200


class PromptEmbedsError(ValueError):
    """A `prompt_embeds` value no worker can take; the message says why and names the field."""


def max_bytes(max_len: int, hidden_size: int) -> int:
    """The most bytes a saved tensor of at most `max_len` float32 rows of `hidden_size` takes."""
    return max_len * hidden_size * 4 + CONTAINER_BYTES


def load(encoded: str, *, hidden_size: int | None, max_len: int) -> torch.Tensor:
    """The [seq_len, hidden_size] tensor `encoded` holds: valid base64 of at most `max_bytes` (checked
    before torch reads it; with `hidden_size` None, unknown, the body limit bounds it), loadable with
    `weights_only`, a dense float32/float16/bfloat16 tensor of 2 dimensions (or 3 with a leading 1),
    `hidden_size` wide, 1 to `max_len` rows, all finite. Raises PromptEmbedsError."""
    if hidden_size and len(encoded) // 4 * 3 > max_bytes(max_len, hidden_size):
        raise PromptEmbedsError(
            f"'prompt_embeds' is too large: about {len(encoded) // 4 * 3} bytes, while {max_len} embeddings of "
            f"this model's hidden size {hidden_size} take at most {max_bytes(max_len, hidden_size)}")
    try:
        payload = base64.b64decode(encoded, validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise PromptEmbedsError("'prompt_embeds' is not valid base64") from None
    import torch

    try:
        tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except MemoryError:
        raise
    except Exception as e:  # torch has no one error type for "not a tensor file": zip, pickle, EOF errors
        reason = (str(e).strip() or type(e).__name__)[:_REASON_CHARS]
        raise PromptEmbedsError(f"'prompt_embeds' could not be read as a torch.save'd tensor: {reason}") from None
    if not isinstance(tensor, torch.Tensor):
        raise PromptEmbedsError(f"'prompt_embeds' must hold a torch.Tensor (it holds a {type(tensor).__name__})")
    if tensor.layout != torch.strided or tensor.is_nested:
        raise PromptEmbedsError(f"'prompt_embeds' must be a dense tensor (got layout {tensor.layout})")
    shape = list(tensor.shape)
    if tensor.dim() == 3 and shape[0] == 1:
        tensor = tensor.squeeze(0)
    if tensor.dim() != 2:
        raise PromptEmbedsError(f"'prompt_embeds' must have shape [seq_len, hidden_size] or "
                                f"[1, seq_len, hidden_size] (got {shape})")
    if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
        raise PromptEmbedsError(f"'prompt_embeds' must be {', '.join(DTYPES)} (got {tensor.dtype})")
    rows, width = tensor.shape
    if hidden_size and width != hidden_size:
        raise PromptEmbedsError(f"'prompt_embeds' has hidden size {width}; this model's is {hidden_size}")
    if rows < 1:
        raise PromptEmbedsError(f"'prompt_embeds' must hold at least one embedding (got shape {shape})")
    if rows > max_len:
        raise PromptEmbedsError(f"'prompt_embeds' has {rows} embeddings; at most {max_len} fit this model's "
                                "context (one generated token must fit too)")
    if not bool(torch.isfinite(tensor).all()):
        raise PromptEmbedsError("'prompt_embeds' holds values that are not finite (NaN or infinity)")
    return tensor.detach()  # a saved nn.Parameter loads as one
