"""The errors of the vLLM integration (both are ``KVLayoutError``, hence ``ValueError``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlayout.errors import KVLayoutError

__all__ = ["GroupProblem", "KVCacheGroupEditError", "UnsupportedKVCacheGroupsError"]

DOCS = "docs/vllm-group-edits.md"


@dataclass(frozen=True)
class GroupProblem:
    """One reason one KV cache group cannot be served, and the layers it concerns."""

    group: int
    what: str
    layers: tuple[str, ...]

    def __str__(self) -> str:
        layers = f" (layers: {', '.join(self.layers)})" if self.layers else ""
        return f"group {self.group}: {self.what}{layers}"


class UnsupportedKVCacheGroupsError(KVLayoutError):
    """The model has KV cache groups kvlayout cannot serve; lists every one of them.

    Example::

        UnsupportedKVCacheGroupsError: kvlayout cannot serve this model's KV cache groups:
        group 1: CrossAttentionSpec: ... (layers: decoder.layers.0.cross_attn); group 2:
        MambaSpec with mamba_cache_mode='none': ... (layers: ...). See docs/vllm-group-edits.md.
    """

    def __init__(self, problems: Sequence[GroupProblem]) -> None:
        self.problems = tuple(problems)
        items = "; ".join(str(p) for p in self.problems)
        super().__init__(f"kvlayout cannot serve this model's KV cache groups: {items}. See {DOCS}.")


class KVCacheGroupEditError(KVLayoutError):
    """A registered tensor a group edit recognises but cannot re-view faithfully.

    Raised instead of registering a view that would move the wrong bytes. The driver
    adds the layer and the group to the rule's message (see :meth:`for_layer`).
    """

    def __init__(self, message: str, *, layer: str | None = None, group: int | None = None) -> None:
        self.detail = message
        self.layer = layer
        self.group = group
        where = "" if layer is None else f"layer {layer!r} (KV cache group {group}): "
        super().__init__(f"{where}{message}")

    def for_layer(self, layer: str, group: int) -> KVCacheGroupEditError:
        return KVCacheGroupEditError(self.detail, layer=layer, group=group)
