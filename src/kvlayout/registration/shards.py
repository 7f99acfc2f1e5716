"""Which of a model's KV heads a tensor-parallel rank holds, by vLLM's rule.

With ``tp_size <= num_kv_heads`` rank ``r`` holds the contiguous range of
``num_kv_heads / tp_size`` heads starting at ``r * num_kv_heads / tp_size``; with more
ranks than heads each rank holds one head, ``r * num_kv_heads // tp_size``, and
``tp_size / num_kv_heads`` ranks hold each head (replication). vLLM requires the larger
of the two to be a multiple of the smaller; so does this. MLA latents have no heads:
every rank holds them whole (the block map asks :attr:`Shard.heads` only of caches that
have a head axis). Where several source ranks hold a head, :meth:`Shard.sends_to` says
which one sends it to a destination rank (``latents=True`` for latents: one source rank
whatever head count the shards carry).

A shard may also hold a slice of a request's *tokens*: vLLM's decode context parallelism
(DCP, ``decode_context_parallel_size``; ``total_cp_world_size`` and ``total_cp_rank`` in
its slot mapping) stores ``cp_interleave`` tokens (``cp_kv_cache_interleave_size``) on CP
rank 0, the next as many on rank 1, and so on round the ranks, each rank's tokens packed
in order into the blocks of the request's block table (the same block ids on every rank,
each block ``cp_size`` times as many of the request's tokens as one rank's block holds):
:mod:`kvlayout.transfer.context_parallel` maps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlayout.errors import KVLayoutError, as_int

__all__ = ["Shard", "ShardError"]


class ShardError(KVLayoutError):
    """A shard that no tensor-parallel split makes, or one that does not fit its cache."""


def _count(name: str, value: object, minimum: int) -> int:
    try:
        value = as_int(value, f"Shard.{name}")  # a NumPy or torch integer too, as block ids take
    except TypeError:
        raise ShardError(f"Shard.{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ShardError(f"Shard.{name} must be >= {minimum}, got {value}")
    return value


def _tp_count(name: str, value: object) -> int:
    """``tp_size`` or ``num_kv_heads``: below 2**32 (a description's shard holds 2**16 at
    most; the CP fields are bounded by their round, below)."""
    value = _count(name, value, 1)
    if value >= 1 << 32:
        raise ShardError(f"Shard.{name}={value} is 2**32 or more: no model has that many ranks or KV heads")
    return value


_MAX_CP_PERIOD = 1 << 62  # a round of the CP ranks, in tokens (int64 token arithmetic)


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``tp_rank`` of ``tp_size`` tensor-parallel ranks of a model with
    ``num_kv_heads`` KV heads (the whole model's, not this rank's); under context
    parallelism, CP rank ``cp_rank`` of ``cp_size``, holding ``cp_interleave`` tokens of
    every ``cp_size * cp_interleave`` (vLLM's ``dcp_rank``, ``decode_context_parallel_size``
    and ``cp_kv_cache_interleave_size``; vLLM's DCP rank is ``tp_rank % cp_size``)."""

    tp_rank: int
    tp_size: int
    num_kv_heads: int
    cp_rank: int = 0
    cp_size: int = 1
    cp_interleave: int = 1

    def __post_init__(self) -> None:
        size = _tp_count("tp_size", self.tp_size)
        heads = _tp_count("num_kv_heads", self.num_kv_heads)
        rank = _count("tp_rank", self.tp_rank, 0)
        cp_size, cp_interleave = (
            _count("cp_size", self.cp_size, 1),
            _count("cp_interleave", self.cp_interleave, 1),
        )
        cp_rank = _count("cp_rank", self.cp_rank, 0)
        for name, value in (
            ("tp_size", size), ("num_kv_heads", heads), ("tp_rank", rank),
            ("cp_rank", cp_rank), ("cp_size", cp_size), ("cp_interleave", cp_interleave),
        ):  # fmt: skip
            object.__setattr__(self, name, value)  # plain ints: a shard compares, hashes and prints alike
        if rank >= size:
            raise ShardError(f"Shard.tp_rank={rank} is out of range for tp_size={size}")
        if cp_rank >= cp_size:
            raise ShardError(f"Shard.cp_rank={cp_rank} is out of range for cp_size={cp_size}")
        if cp_size * cp_interleave > _MAX_CP_PERIOD:
            raise ShardError(
                f"Shard.cp_size={cp_size} * cp_interleave={cp_interleave} tokens a round of the CP ranks is "
                f"more than 2**62: block maps count a request's tokens in int64"
            )
        if max(size, heads) % min(size, heads):
            raise ShardError(
                f"tp_size={size} and num_kv_heads={heads}: the larger must be a multiple of the smaller "
                "(engines split KV heads evenly over ranks or replicate each head over the same "
                "number of ranks; num_kv_heads is the model's attention KV heads, for a Mamba state's "
                "shard too)"
            )

    @property
    def context_parallel(self) -> bool:
        """The rank holds a slice of each request's tokens (``cp_size > 1``)."""
        return self.cp_size > 1

    @property
    def replicated(self) -> bool:
        """More ranks than heads: this rank's one head is held by other ranks too."""
        return self.tp_size > self.num_kv_heads

    @property
    def heads(self) -> range:
        """The model heads this rank holds, in the order its cache stores them."""
        if self.replicated:
            head = self.tp_rank * self.num_kv_heads // self.tp_size
            return range(head, head + 1)
        per = self.num_kv_heads // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    @property
    def replicas(self) -> int:
        """How many ranks hold this rank's heads (1 but for replication)."""
        return max(1, self.tp_size // self.num_kv_heads)

    def sends_to(self, dst: Shard, *, latents: bool = False) -> bool:
        """Whether this source rank is the one that sends ``dst`` the heads both hold,
        where several source ranks hold them (replication): otherwise every replica would
        send the same bytes, written as many times. ``dst`` takes each head from the
        replica whose ordinal is that of source rank ``dst.tp_rank * tp_size //
        dst.tp_size``, vLLM's NixlConnector's rule (a decode rank reads from that prefill
        rank), which spreads destination ranks over the replicas. Without replication
        every rank sends what it holds (the block map of a pair with no head in common is
        empty). MLA latents, which every rank holds, are one head replicated over every
        rank: ``latents=True`` (a map's :attr:`BlockMap.latents
        <kvlayout.transfer.BlockMap.latents>`) says so, and ``dst`` takes them from source
        rank ``dst.tp_rank * tp_size // dst.tp_size`` alone, whatever ``num_kv_heads`` the
        shards carry (the model's attention heads, a drafter's KV heads beside an MLA
        target's latents: one registration, one shard); without it the shards must say
        ``num_kv_heads=1`` (``Shard(rank, tp_size, 1)`` on both sides), or every source rank
        that holds as many heads as ranks sends them. A destination under context
        parallelism (decode's DCP) changes nothing here: a source without CP holds every
        token, so its replicas are the ranks that hold the same heads, and the rule is the
        same (vLLM's ``compute_tp_mapping`` reads MLA from rank ``tp_rank * remote_tp //
        tp`` whatever the local DCP). A source under CP is refused."""
        if not isinstance(dst, Shard):
            raise TypeError(f"sends_to takes the destination's Shard, not {type(dst).__name__}")
        if self.context_parallel:
            raise ShardError(
                f"sends_to({dst}) from {self}: under context parallelism each source CP rank holds "
                "its own tokens, so replicas are the ranks of one CP rank that hold the same heads, "
                "which a shard alone does not know; pair ranks by what block_map moves between them "
                "(an empty map: nothing in common) and, where several source ranks of one CP rank "
                "hold the same heads, send from one"
            )
        if dst.num_kv_heads != self.num_kv_heads:
            raise ShardError(
                f"{self} and {dst} count {self.num_kv_heads} and {dst.num_kv_heads} model KV heads: one "
                "model has one count"
            )
        replicas = self.tp_size if latents else self.replicas  # latents: every rank holds them
        return self.tp_rank % replicas == (dst.tp_rank * self.tp_size // dst.tp_size) % replicas

    def __str__(self) -> str:
        cp = (
            f", cp_rank={self.cp_rank}, cp_size={self.cp_size}, cp_interleave={self.cp_interleave}"
            if self.context_parallel
            else ""
        )
        return f"Shard(tp_rank={self.tp_rank}, tp_size={self.tp_size}, num_kv_heads={self.num_kv_heads}{cp})"


def heads_are_the_model_s(has_heads: bool, opaque_pages: object | None) -> bool:
    """Whether a cache's head axis counts the model's KV heads, so that a shard must hold
    as many: not for latents (MLA: every rank holds them whole, no head axis), nor for
    opaque pages, whose head axis (vLLM's LHBNC head slots) counts the kernel's slots."""
    return has_heads and opaque_pages is None
