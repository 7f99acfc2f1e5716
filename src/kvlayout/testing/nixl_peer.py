"""A NIXL peer in another process, for tests, benchmarks and demos of the NIXL path.

``NixlPeer(name, [nbytes, ...])`` starts ``python -m kvlayout.testing.nixl_peer``: a child
process with its own NIXL agent (UCX; between processes here that is TCP on loopback)
holding host buffers filled with seeded random bytes (:func:`contents`), all registered
or only the stretches given. The parent drives it over its pipes, one JSON line per
command, each answer awaited with a deadline (the child is killed on overrun):
``read`` a buffer back, ``fill`` it again, collect ``notifs``, ``stop``. ``pause`` and
``resume`` stop and continue it (a transfer to a stopped peer does not finish).

:meth:`NixlPeer.side` is the peer's buffers as a :class:`~kvlayout.transfer.nixl.MapSide`
(what a real peer's registration description provides).

A peer can also hold a real kvlayout cache: :meth:`NixlPeer.cache` sends a small
:class:`CacheSpec` (format, sizes, dtype, shard, seed), the child builds it with
:func:`build_cache` (seeded bytes, so this process can build its twin), binds it,
registers it with NIXL and answers its ``describe(shard=...).to_json()``: the handshake
of a P/D connector. :meth:`NixlPeer.cache_bytes` reads its tensors back. :meth:`NixlPeer.built_cache` has the
peer build a cache with a function of its own instead (a vLLM engine's, say), named by
module and name.
:meth:`NixlPeer.staging` gives it a registered staging buffer; :meth:`NixlPeer.unstage`
scatters a peer-staged WRITE from it, :meth:`NixlPeer.stage` gathers a request into it
for a peer-staged READ (the peer's halves of that strategy), either planned ahead with
:meth:`NixlPeer.prepare` and run with :meth:`NixlPeer.run_prepared`, and either paced by
NIXL notifications to the poster (:class:`Paced`; :meth:`NixlPeer.add_remote` loads the
poster's metadata, so the peer can send them). :meth:`NixlPeer.stage_joined` and
:meth:`NixlPeer.unstage_joined` do the same for a joined request (a hybrid's kernel groups,
one :class:`Part` each).

What kvlayout keeps between requests (:func:`kept`: its registries, caches and live
objects, counted) is asked of the child with :meth:`NixlPeer.kept`, and its Python
allocations' growth (tracemalloc) with :meth:`NixlPeer.trace`: a connector's memory must
not grow with the requests it moves.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from kvlayout.transfer.nixl import PeerStaging

__all__ = [
    "BufferSide",
    "CacheSpec",
    "NixlPeer",
    "Paced",
    "Part",
    "build_cache",
    "cache_sizes",
    "contents",
    "kept",
    "tcp_tls",
]


def contents(seed: int, buffer: int, nbytes: int) -> np.ndarray:
    """The bytes a peer fills buffer ``buffer`` with for ``seed``."""
    return np.random.default_rng((seed, buffer)).integers(0, 256, nbytes, dtype=np.uint8)


def kept(agent: Any) -> dict[str, int]:
    """The size of everything kvlayout keeps between calls, by name: each container and
    cache at module level in its modules (registries such as the peers' staging buffers
    in use or the releases left for later, lru caches), ``agent``'s regions' tables (a
    table of counts, such as the requests pinning each region, by its total), and
    the live objects of each of its classes (requests, holds, plans, maps). A loop of
    requests that leaves these as it found them keeps nothing per request."""
    from kvlayout.transfer.nixl.regions import _REGIONS

    containers = (dict, list, set, collections.deque, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
    sizes: dict[str, int] = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] != "kvlayout":
            continue
        for attr, value in list(vars(module).items()):
            info = getattr(value, "cache_info", None)
            if isinstance(value, containers) and not attr.startswith("__"):
                sizes[f"{module_name}.{attr}"] = len(value)
            elif callable(info) and getattr(value, "__module__", None) == module_name:
                sizes[f"{module_name}.{attr}()"] = info().currsize
    tables = vars(_REGIONS[agent]) if agent in _REGIONS else {}
    for k, v in tables.items():
        if isinstance(v, dict) and all(isinstance(n, int) for n in v.values()):
            sizes[f"regions.{k}"] = sum(v.values())  # a count per region (pins) grows in place
        elif hasattr(v, "__len__"):
            sizes[f"regions.{k}"] = len(v)
    gc.collect()
    alive = collections.Counter(type(o).__qualname__ for o in gc.get_objects() if _of_kvlayout(o))
    return sizes | {f"alive {k}": n for k, n in alive.items()}


def _of_kvlayout(o: object) -> bool:
    return str(getattr(type(o), "__module__", "")).split(".")[0] == "kvlayout"


@dataclass(frozen=True)
class CacheSpec:
    """A small cache of one format: ``heads`` KV heads this rank holds (ignored by MLA),
    heads' rows of ``row`` elements, tensor-parallel ``shard`` as (rank, size, model
    heads) (then CP rank, CP size and interleave under context parallelism) or None,
    bytes seeded by ``seed``; ``shares`` lists ``(layer, target)`` pairs, a layer
    registered with an earlier layer's tensor (vLLM's cross-layer KV sharing; a format
    with one tensor a layer); ``engine_groups``, each layer's engine (KV cache) group
    (``bind``'s; () puts every layer in group 0): a hybrid of groups of one format, as
    vLLM's full and sliding-window attention, one kernel group each."""

    format: str  # an EngineKVFormat name
    layers: int
    blocks: int
    block_size: int
    heads: int
    row: int
    dtype: str = "bfloat16"
    shard: tuple[int, ...] | None = None
    seed: int = 0
    shares: tuple[tuple[int, int], ...] = ()
    engine_groups: tuple[int, ...] = ()

    def to_data(self) -> dict[str, Any]:
        shard = None if self.shard is None else list(self.shard)
        return {**self.__dict__, "shard": shard, "shares": [list(p) for p in self.shares],
                "engine_groups": list(self.engine_groups)}  # fmt: skip

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> CacheSpec:
        shard = data["shard"]
        return cls(**{
            **data,
            "shard": None if shard is None else tuple(int(x) for x in shard),
            "shares": tuple((int(a), int(b)) for a, b in data.get("shares", ())),
            "engine_groups": tuple(int(g) for g in data.get("engine_groups", ())),
        })  # fmt: skip

    @property
    def the_shard(self) -> Any:
        from kvlayout.registration.shards import Shard

        return None if self.shard is None else Shard(*self.shard)


def cache_sizes(spec: CacheSpec) -> dict[str, int]:
    """The layout's sizes of ``spec`` (block count and block size apart, even where the
    tensors fold them into one page axis)."""
    from kvlayout import EngineKVFormat, layout_of
    from kvlayout.layout.algebra import sizes_by_role
    from kvlayout.layout.vocabulary import Role

    by_role = {Role.LAYER: spec.layers, Role.BLOCK: spec.blocks, Role.TOKEN: spec.block_size}
    by_role |= {Role.HEAD: spec.heads, Role.KV: 2, Role.ELEMENT: spec.row}
    return sizes_by_role(layout_of(EngineKVFormat[spec.format]), by_role)


def build_cache(spec: CacheSpec, device: str = "cpu") -> tuple[Any, list[Any]]:
    """The bound registration of ``spec`` and its leaves (in pointer order) on ``device``,
    each leaf's bytes :func:`contents` of ``(spec.seed, leaf index)``: two processes (or
    the host and a GPU) build twins."""
    import torch

    from kvlayout import EngineKVFormat, layout_of
    from kvlayout.registration.registration import bind

    fmt = EngineKVFormat[spec.format]
    layout = layout_of(fmt)
    sizes = cache_sizes(spec)
    shape = layout.tensor_shape(sizes)
    dtype = getattr(torch, spec.dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    leaves = [
        torch.from_numpy(contents(spec.seed, i, nbytes)).view(dtype).view(shape).to(device)
        for i in range(len(layout.pointer_order(sizes)))
    ]
    if spec.shares and tuple(layout.list_shape(sizes)) != (spec.layers,):
        raise ValueError(f"{spec.format} has not one tensor a layer: its layers cannot share one")
    for layer, target in spec.shares:
        leaves[layer] = leaves[target]
    groups = list(spec.engine_groups) or None
    return bind(_nest(layout.list_shape(sizes), leaves), fmt, engine_groups=groups), leaves


def refill(spec: CacheSpec, leaves: list[Any]) -> None:
    """Write the seeded bytes :func:`build_cache` gave ``spec``'s leaves again (a layer
    sharing another's tensor holds that layer's)."""
    import torch

    sharers = {layer for layer, _ in spec.shares}
    for i, t in enumerate(leaves):
        if i not in sharers:
            seeded = contents(spec.seed, i, t.numel() * t.element_size())
            t.view(-1).view(torch.uint8).copy_(torch.from_numpy(seeded))


def _nest(extents: Sequence[int], leaves: list[Any]) -> Any:
    """Leaves in pointer order as the registration's nested lists (a list outside, tuples in)."""

    def build(depth: int, items: list[Any]) -> Any:
        if depth == len(extents):
            return items[0]
        step = len(items) // extents[depth]
        parts = [build(depth + 1, items[i * step : (i + 1) * step]) for i in range(extents[depth])]
        return tuple(parts) if depth > 0 else parts

    return build(0, leaves) if extents else leaves[0]


def tcp_tls() -> str:
    """``UCX_TLS`` for TCP alone between processes of one machine (so that a stopped peer
    holds a transfer up, and loopback measures a network rather than UCX's shared-memory
    copies): ``tcp``, with ``cuda_copy`` where torch sees a GPU, since NIXL's UCX backend
    does not start there without a CUDA transport (seen on an H200 with nixl-cu13).
    cuda_copy moves no host memory; on a CPU-only machine UCX would warn that it is absent."""
    import torch

    return "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"


class Paced(NamedTuple):
    """A pipelined peer-staged request's pacing, for :meth:`NixlPeer.stage` and
    :meth:`NixlPeer.unstage`: its ``stages`` (None: the default both sides make), the
    poster's agent name, the request's tag; ``wait=False`` returns once the command is
    sent (:meth:`NixlPeer.answer` then awaits it, named ``"stage"``, ``"unstage"`` or
    ``"run_prepared"``)."""

    stages: int | None
    poster: str
    tag: str
    wait: bool = True


@dataclass(frozen=True)
class BufferSide:
    """Host buffers of a peer process, as a map side: its described tensors."""

    tensor_spans: np.ndarray  # (K, 2) uint64: address, bytes
    device_type: str = "cpu"
    device_index: int = 0
    is_local: bool = False

    def moved(self) -> None:
        return None  # a peer's memory: nothing here to move


class NixlPeer:
    """A NIXL agent in a child process holding ``buffers`` (bytes each) of seeded bytes.

    ``registered`` lists ``(buffer, offset, nbytes)`` stretches to register with NIXL
    instead of every buffer whole (a peer whose description claims more than it
    registered). Every answer is awaited at most ``timeout`` seconds. ``env`` adds to
    the child's environment (``UCX_TLS``, say). Without ``progress_thread`` the child
    drives NIXL itself every millisecond it waits for a command (cheap, enough for
    tests); with it, NIXL's own thread does, as in an engine (faster, but it polls
    without pause and takes a core).
    """

    def __init__(
        self,
        name: str,
        buffers: Sequence[int],
        *,
        seed: int = 0,
        registered: Sequence[tuple[int, int, int]] | None = None,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        progress_thread: bool = False,
    ) -> None:
        self.name = name
        self.timeout = timeout
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the child writes it while it lives
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvlayout.testing.nixl_peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
        )
        self._pending = b""
        try:
            answer = self.call(
                "init",
                name=name,
                buffers=list(buffers),
                seed=seed,
                registered=None if registered is None else [list(r) for r in registered],
                progress_thread=progress_thread,
            )
        except BaseException:
            self.kill()
            raise
        self.metadata = base64.b64decode(answer["metadata"])
        self.buffers: list[tuple[int, int]] = [(int(a), int(n)) for a, n in answer["buffers"]]
        self.seed = seed

    @property
    def pid(self) -> int:
        return self._proc.pid

    def __repr__(self) -> str:
        return f"NixlPeer({self.name!r}, pid {self.pid}, {len(self.buffers)} buffers)"

    def side(self, buffers: Sequence[int] | None = None) -> BufferSide:
        """The peer's buffers (all, or those listed) as a map side."""
        chosen = range(len(self.buffers)) if buffers is None else buffers
        return BufferSide(np.array([self.buffers[i] for i in chosen], dtype=np.uint64).reshape(-1, 2))

    def address(self, buffer: int, offset: int = 0) -> int:
        return self.buffers[buffer][0] + offset

    # -- commands ---------------------------------------------------------------------

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (killing the child on overrun)."""
        self.send(cmd, **args)
        return self.answer(cmd)

    def send(self, cmd: str, **args: Any) -> None:
        """Send one command, its answer awaited later with :meth:`answer` (one at a time)."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"peer {self.name!r} has exited ({self._proc.returncode}){self._stderr()}")
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        self._proc.stdin.flush()

    def answer(self, cmd: str) -> dict[str, Any]:
        """The answer to the command sent last (``cmd`` names it in an error)."""
        answer: dict[str, Any] = json.loads(self._line(self.timeout))
        if "error" in answer:
            raise RuntimeError(f"peer {self.name!r} failed {cmd}: {answer['error']}")
        return answer

    def add_remote(self, metadata: bytes) -> str:
        """Load another agent's NIXL metadata in the peer (so it can send that agent
        notifications); the agent's name. The same agent's metadata again is taken; an
        agent NIXL refuses (another of that name loaded: :meth:`remove_remote` it first) is a
        ``NixlError``."""
        from kvlayout.transfer.nixl import NixlError

        self.send("remote", metadata=base64.b64encode(metadata).decode())
        answer: dict[str, Any] = json.loads(self._line(self.timeout))
        if answer.get("error", "").startswith("NixlError: "):  # _load_remote's, in the child
            raise NixlError(answer["error"].removeprefix("NixlError: "))
        if "error" in answer:
            raise RuntimeError(f"peer {self.name!r} failed remote: {answer['error']}")
        name: str = answer["name"]
        return name

    def remove_remote(self, name: str) -> None:
        """Drop the metadata of agent ``name`` that the peer loaded (NIXL's
        ``remove_remote_agent``)."""
        self.call("unremote", name=name)

    def read(self, buffer: int, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Bytes of one of the peer's buffers, as it holds them now."""
        n = self.buffers[buffer][1] - offset if nbytes is None else nbytes
        answer = self.call("read", buffer=buffer, offset=offset, nbytes=n)
        return np.frombuffer(base64.b64decode(answer["data"]), dtype=np.uint8)

    def fill(self, seed: int) -> None:
        """Refill every buffer with :func:`contents` of ``seed``."""
        self.call("fill", seed=seed)
        self.seed = seed

    def cache(self, spec: CacheSpec, device: str = "cpu") -> str:
        """Build, register and describe ``spec`` in the peer on ``device`` (replacing its
        cache); the description's JSON, as a connector's handshake carries it. The peer's
        NIXL metadata changes with its registrations: :attr:`metadata` is the new one
        (load it again with ``add_remote_agent``)."""
        answer = self.call("cache", spec=spec.to_data(), device=device)
        self.metadata = base64.b64decode(answer["metadata"])
        text: str = answer["description"]
        return text

    def built_cache(self, builder: str, shard: Sequence[int] | None = None, **args: Any) -> str:
        """Build a cache in the peer with ``builder`` (``"module:function"``, imported and
        called there with ``args``, which must be JSON), register it with NIXL and describe
        it with ``shard`` ((rank, size, model heads) or None), replacing its cache; the
        description's JSON, as :meth:`cache` answers. The builder returns the registration
        and the tensors :meth:`cache_bytes` reads back (an engine's whole buffer, say):
        deterministic in ``args``, so this process can build its twin."""
        answer = self.call(
            "built_cache", builder=builder, args=args, shard=None if shard is None else list(shard)
        )
        self.metadata = base64.b64decode(answer["metadata"])
        text: str = answer["description"]
        return text

    def cache_bytes(self) -> list[np.ndarray]:
        """The bytes of each tensor of the peer's cache, in pointer order, as it holds them now."""
        answer = self.call("cache_read")
        return [np.frombuffer(base64.b64decode(d), dtype=np.uint8) for d in answer["leaves"]]

    def cache_read_at(self, address: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of the peer's cache at ``address`` (inside one of its tensors)."""
        answer = self.call("cache_read_at", address=address, nbytes=nbytes)
        return np.frombuffer(base64.b64decode(answer["data"]), dtype=np.uint8)

    def staging(self, nbytes: int, device: str = "cpu") -> PeerStaging:
        """Give the peer a registered staging buffer of ``nbytes`` on ``device``
        (replacing any); its :class:`~kvlayout.transfer.nixl.PeerStaging` (load
        :attr:`metadata` again)."""
        from kvlayout.transfer.nixl import PeerStaging

        answer = self.call("staging", nbytes=nbytes, device=device)
        self.metadata = base64.b64decode(answer["metadata"])
        where = answer["device"]
        return PeerStaging(int(answer["address"]), int(answer["nbytes"]), where[0], int(where[1]))

    def unstage(
        self, description: str, src_ids: Sequence[int], dst_ids: Sequence[int], *,
        paced: Paced | None = None, expect: str | None = None, **kw: Any,
    ) -> None:  # fmt: skip
        """The peer's half of a peer-staged WRITE: it builds the request's map from the
        source's ``description`` (JSON) into its cache (``block_map`` keywords in ``kw``)
        and scatters its staging buffer with ``unstage``; with ``paced``, stage by stage
        as the WRITE's stages land (send it with ``wait=False`` before posting). ``expect``:
        the poster's map's fingerprint, which the peer's map must have."""
        self._staging_copy("unstage", description, src_ids, dst_ids, paced, kw, expect)

    def stage(
        self, description: str, src_ids: Sequence[int], dst_ids: Sequence[int], *,
        paced: Paced | None = None, expect: str | None = None, **kw: Any,
    ) -> None:  # fmt: skip
        """The peer's half of a peer-staged READ: it builds the request's map from its
        cache into the destination's ``description`` (JSON) and gathers it into its
        staging buffer with ``stage``; with ``paced``, announcing each stage to the poster
        as it is gathered (``wait=False``: post the READ with ``peer_ready`` meanwhile)."""
        self._staging_copy("stage", description, src_ids, dst_ids, paced, kw, expect)

    def stage_joined(
        self,
        description: str,
        parts: Sequence[Part],
        *,
        paced: Paced | None = None,
        expect: str | None = None,
    ) -> None:
        """:meth:`stage` of a joined request (a hybrid's groups, one transfer): the peer
        maps each part's kernel group of its cache into the same group of the poster's
        ``description`` and joins them (``join_maps``), in the order given."""
        self._staging_copy("stage", description, [], [], paced, {}, expect, parts)

    def unstage_joined(
        self,
        description: str,
        parts: Sequence[Part],
        *,
        paced: Paced | None = None,
        expect: str | None = None,
    ) -> None:
        """:meth:`unstage` of a joined request: each part's group of the poster's
        ``description`` into the same group of the peer's cache, joined."""
        self._staging_copy("unstage", description, [], [], paced, {}, expect, parts)

    def _staging_copy(
        self, cmd: str, description: str, src_ids: Sequence[int], dst_ids: Sequence[int],
        paced: Paced | None, kw: dict[str, Any], expect: str | None, parts: Sequence[Part] | None = None,
    ) -> None:  # fmt: skip
        args = _request(description, src_ids, dst_ids, kw, expect)
        if parts is not None:
            args["parts"] = [[p.group, list(p.src_ids), list(p.dst_ids), p.kw] for p in parts]
        if paced is None:
            self.call(cmd, **args)
            return
        self.send(cmd, **args, paced=paced._asdict())
        if paced.wait:
            self.answer(cmd)

    def prepare(
        self, which: str, description: str, src_ids: Sequence[int], dst_ids: Sequence[int], *,
        stages: int | None = None, expect: str | None = None, **kw: Any,
    ) -> None:  # fmt: skip
        """Tell the peer of a request before its bytes move: it plans its half (``which``:
        ``"stage"`` or ``"unstage"``, in ``stages``; None: by default; ``expect``: the
        poster's map's fingerprint) with ``prepare_stage`` or ``prepare_unstage`` now, and
        :meth:`run_prepared` runs it."""
        args = _request(description, src_ids, dst_ids, kw, expect)
        self.call("prepare", which=which, stages=stages, **args)

    def run_prepared(self, *, paced: Paced | None = None) -> None:
        """Run the prepared half (``paced``: by the poster's notifications, its
        ``stages`` the prepared ones; ``wait=False`` returns once sent)."""
        if paced is None:
            self.call("run_prepared")
            return
        self.send("run_prepared", paced=paced._asdict())
        if paced.wait:
            self.answer("run_prepared")

    def refill_cache(self) -> None:
        """Write the peer's cache's seeded bytes again."""
        self.call("cache_fill")

    def notifs(self, expect: int = 1, wait: float = 10.0) -> list[bytes]:
        """Notifications received so far, waiting up to ``wait`` seconds for ``expect``."""
        answer = self.call("notifs", expect=expect, wait=wait)
        return [base64.b64decode(m) for m in answer["notifs"]]

    def kept(self) -> dict[str, int]:
        """:func:`kept` of the peer's agent, in the peer."""
        sizes: dict[str, int] = self.call("kept")["sizes"]
        return sizes

    def trace(self, keep: str, since: str | None = None, top: int = 10) -> list[str]:
        """The peer's Python allocations (tracemalloc, started by the first call): a
        snapshot taken now and kept as ``keep``, and the ``top`` lines that grew most
        since the snapshot kept as ``since`` (none without it)."""
        lines: list[str] = self.call("trace", keep=keep, since=since, top=top)["top"]
        return lines

    def pause(self) -> None:
        """Stop the child, returning once it is stopped (a signal lands asynchronously)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + self.timeout
        while _state(self.pid) not in ("T", "t"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.name!r} did not stop within {self.timeout:g} s")
            time.sleep(1e-3)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a broken pipe to a child already gone
                    pipe.close()
        self._log.close()

    def close(self) -> None:
        """Stop the child (politely, then by force)."""
        if self._proc.poll() is None:
            try:
                self.resume()
                self.call("stop")
                self._proc.wait(10)
            except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def __enter__(self) -> NixlPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipe ---------------------------------------------------------------------

    def _stderr(self) -> str:
        try:
            self._log.seek(0)
            tail = self._log.read()[-2000:].decode(errors="replace")
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends:\n{tail}" if tail else ""

    def _line(self, timeout: float) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    log = self._stderr()
                    self.kill()
                    raise TimeoutError(
                        f"peer {self.name!r} did not answer within {timeout:g} s (killed){log}"
                    )
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self._proc.wait(10)
                    raise RuntimeError(f"peer {self.name!r} exited ({self._proc.returncode}){self._stderr()}")
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line


class AgentPair(NamedTuple):
    """This process's agent, the :class:`NixlPeer` it has loaded (``name``: the peer's
    name here) and a staging buffer registered with the agent."""

    agent: Any
    peer: NixlPeer
    name: str
    staging: Any


@contextlib.contextmanager
def agent_pair(
    name: str, buffers: Sequence[int], staging_bytes: int, *, env: dict[str, str] | None = None
) -> Iterator[AgentPair]:
    """A two-agent pair for tests: a :class:`NixlPeer` child (``name``-peer, holding
    ``buffers``, ``env`` added to its environment) loaded by an agent of this process
    (``name``, no progress thread) with a ``staging_bytes`` staging buffer; the staging
    buffer closed and the child stopped on exit."""
    from kvlayout.transfer import nixl as nx

    peer = NixlPeer(f"{name}-peer", buffers, env=env)
    try:
        agent = nx.make_agent(name, progress_thread=False)
        peer_name = agent.add_remote_agent(peer.metadata).decode()
        with nx.Staging(agent, staging_bytes) as staging:
            yield AgentPair(agent, peer, peer_name, staging)
    finally:
        peer.close()


def _request(
    description: str, src_ids: Sequence[int], dst_ids: Sequence[int], kw: dict[str, Any], expect: str | None
) -> dict[str, Any]:
    """A request the peer maps its half of: the poster's description, both block lists,
    ``block_map`` keywords and the poster's map's fingerprint (None: not checked)."""
    return {"description": description, "src_ids": list(src_ids), "dst_ids": list(dst_ids), "kw": kw,
            "expect": expect}  # fmt: skip


class Part(NamedTuple):
    """One kernel group's map of a joined request (:meth:`NixlPeer.stage_joined`): the
    group's index on both sides, its block lists and ``block_map`` keywords (JSON)."""

    group: int
    src_ids: Sequence[int]
    dst_ids: Sequence[int]
    kw: dict[str, Any]


def _state(pid: int) -> str:
    """A process's state letter from /proc (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# -- the child --------------------------------------------------------------------------------


def _serve() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed (NIXL's logs) goes to stderr, not into the protocol
    import torch

    from kvlayout.registration.shards import Shard
    from kvlayout.transfer import RegistrationDescription, block_map, join_maps
    from kvlayout.transfer.nixl import Staging, make_agent, prepare_stage, prepare_unstage, register
    from kvlayout.transfer.nixl.sides import _peer_name  # the agent name as a str

    agent: Any = None
    buffers: list[np.ndarray] = []
    cache: Any = None  # (spec or None where built, leaves, Registered, registration, Shard or None)
    staging: Any = None  # a Staging, for peer-staged requests
    prepared: Any = None  # a PeerCopy: the request the parent said is coming
    snapshots: dict[str, tracemalloc.Snapshot] = {}  # the trace command's, by name

    def progress() -> None:  # drives NIXL (the agent has no progress thread), keeping notifications
        if agent is not None:  # in agent.notifs, where unstage's take_notif finds them too
            agent.update_notifs()

    def notifs() -> list[bytes]:
        return [m for msgs in agent.notifs.values() for m in msgs]

    commands = _lines(sys.stdin.buffer.fileno(), progress)
    for msg in commands:
        cmd = msg["cmd"]
        try:
            if cmd == "init":
                agent = make_agent(msg["name"], progress_thread=msg["progress_thread"])
                buffers = [np.empty(n, dtype=np.uint8) for n in msg["buffers"]]
                for i, b in enumerate(buffers):
                    b[:] = contents(msg["seed"], i, len(b))
                stretches = msg["registered"] or [[i, 0, len(b)] for i, b in enumerate(buffers)]
                regions = [(buffers[i].ctypes.data + off, n, 0, "") for i, off, n in stretches]
                agent.register_memory(regions, "DRAM")
                answer: dict[str, Any] = {
                    "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                    "buffers": [[b.ctypes.data, len(b)] for b in buffers],
                }
            elif cmd == "read":
                data = buffers[msg["buffer"]][msg["offset"] : msg["offset"] + msg["nbytes"]]
                answer = {"data": base64.b64encode(data.tobytes()).decode()}
            elif cmd == "fill":
                for i, b in enumerate(buffers):
                    b[:] = contents(msg["seed"], i, len(b))
                answer = {}
            elif cmd == "notifs":
                deadline = time.monotonic() + msg["wait"]
                progress()
                while len(notifs()) < msg["expect"] and time.monotonic() < deadline:
                    time.sleep(1e-3)
                    progress()
                answer = {"notifs": [base64.b64encode(m).decode() for m in notifs()]}
                agent.notifs = {}
            elif cmd == "remote":
                answer = {"name": _peer_name(_load_remote(agent, base64.b64decode(msg["metadata"])))}
            elif cmd == "unremote":
                agent.remove_remote_agent(msg["name"])
                answer = {}
            elif cmd == "cache":
                if cache is not None:
                    cache[2].deregister()
                spec = CacheSpec.from_data(msg["spec"])
                reg, leaves = build_cache(spec, msg.get("device", "cpu"))
                cache = (spec, leaves, register(agent, reg), reg, spec.the_shard)
                desc = reg.describe(shard=spec.the_shard, block_size=spec.block_size)
                answer = {
                    "description": desc.to_json(),
                    "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                }
            elif cmd == "built_cache":
                if cache is not None:
                    cache[2].deregister()
                    cache = None
                module, _, name = msg["builder"].partition(":")
                reg, leaves = getattr(importlib.import_module(module), name)(**msg["args"])
                shard = None if msg["shard"] is None else Shard(*msg["shard"])
                cache = (None, list(leaves), register(agent, reg), reg, shard)
                answer = {
                    "description": reg.describe(shard=shard).to_json(),
                    "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                }
            elif cmd == "staging":
                if staging is not None:
                    staging.close()
                staging = Staging(agent, msg["nbytes"], device=msg.get("device", "cpu"))
                answer = {
                    "address": staging.address,
                    "nbytes": staging.nbytes,
                    "device": [staging.device.type, staging.device.index or 0],
                    "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                }
            # This cache is a stage's source, an unstage's destination; prepare plans either.
            elif cmd in ("stage", "unstage", "prepare"):
                which = msg.get("which", cmd)
                desc = RegistrationDescription.from_json(msg["description"])
                here = "src" if which == "stage" else "dst"
                parts = msg.get("parts") or [[None, msg["src_ids"], msg["dst_ids"], msg["kw"]]]
                maps = []
                for group, src_ids, dst_ids, kw in parts:  # one map, or a joined request's groups
                    mine = cache[3] if group is None else cache[3].kernel_groups[group]
                    theirs = desc if group is None else desc.group(group)
                    src, dst = (mine, theirs) if here == "src" else (theirs, mine)
                    maps.append(block_map(src, dst, src_ids, dst_ids, **{**kw, f"{here}_shard": cache[4]}))
                request = maps[0] if msg.get("parts") is None else join_maps(maps)
                paced = msg.get("paced")
                stages = paced["stages"] if paced else msg.get("stages")
                half = prepare_stage if here == "src" else prepare_unstage
                copy = half(request, staging, stages=stages, expect=msg.get("expect"))
                if cmd == "prepare":
                    prepared = copy
                else:
                    copy.run(notifs=_notifs(agent, paced))
                answer = {}
            elif cmd == "run_prepared":
                if prepared is None:
                    raise ValueError("no request was prepared")
                copy, prepared = prepared, None
                copy.run(notifs=_notifs(agent, msg.get("paced")))
                answer = {}
            elif cmd == "cache_read":
                answer = {"leaves": [base64.b64encode(_host_bytes(t).numpy()).decode() for t in cache[1]]}
            elif cmd == "cache_read_at":
                at, n = msg["address"], msg["nbytes"]
                inside = [t for t in cache[1] if t.data_ptr() <= at and at + n <= t.data_ptr() + t.nbytes]
                if not inside:
                    raise ValueError(f"{at:#x} (+{n}) is outside every tensor of the cache")
                off = at - inside[0].data_ptr()
                raw = _host_bytes(inside[0].view(-1).view(torch.uint8)[off : off + n])
                answer = {"data": base64.b64encode(raw.numpy().tobytes()).decode()}
            elif cmd == "cache_fill":
                if cache[0] is None:
                    raise ValueError("a built cache is not refilled: build it again")
                refill(cache[0], cache[1])
                answer = {}
            elif cmd == "kept":
                answer = {"sizes": kept(agent)}
            elif cmd == "trace":
                if not tracemalloc.is_tracing():
                    tracemalloc.start(8)
                own = tracemalloc.Filter(False, tracemalloc.__file__)  # the snapshots themselves
                snapshot = snapshots[msg["keep"]] = tracemalloc.take_snapshot().filter_traces([own])
                since = snapshots.get(msg["since"]) if msg["since"] else None
                grown = [] if since is None else snapshot.compare_to(since, "lineno")[: msg["top"]]
                answer = {"top": [str(line) for line in grown]}
            elif cmd == "stop":
                out.write("{}\n")
                out.flush()
                return
            else:
                answer = {"error": f"unknown command {cmd!r}"}
        except Exception as exc:  # report it to the parent, which raises
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _load_remote(agent: Any, metadata: bytes) -> bytes:
    """``agent.add_remote_agent(metadata)``, NIXL's refusal a ``NixlError`` saying why.
    NIXL takes an agent's metadata again (adding the regions it registered since, keeping
    those it deregistered), but refuses an agent of a name it holds whose connections
    differ (another agent, as one restarted under its name) and its own metadata; its
    error names neither agent."""
    from kvlayout.transfer.nixl import NixlError

    try:
        name: bytes = agent.add_remote_agent(metadata)
    except Exception as exc:  # NIXL's bindings' classes (nixlNotAllowedError, ...), raw
        why = ""
        if type(exc).__name__ in ("nixlNotAllowedError", "nixlInvalidParamError"):  # what either case raises
            why = (
                ": it holds an agent of that name already, loaded from another agent's metadata (one "
                "restarted under its name), or it is its own; remove_remote_agent(that name) first"
            )
        raise NixlError(
            f"agent {agent.name!r} could not load the metadata ({type(exc).__name__}: {exc}){why}"
        ) from exc
    return name


def _host_bytes(t: Any) -> Any:
    """A tensor's bytes as a flat uint8 tensor in host memory (copied from a GPU)."""
    import torch

    return t.view(-1).view(torch.uint8).cpu()


def _notifs(agent: Any, paced: dict[str, Any] | None) -> Any:
    """A paced command's StageNotifs (None unpaced), naming the poster as a connector has
    it: the bytes ``add_remote_agent`` returned."""
    from kvlayout.transfer.nixl import StageNotifs

    return None if paced is None else StageNotifs(agent, paced["poster"].encode(), paced["tag"].encode())


def _lines(fd: int, idle: Any) -> Any:
    """JSON commands from ``fd``, calling ``idle`` every millisecond while none comes."""
    pending = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                yield json.loads(line)
            if sel.select(1e-3):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return  # the parent has gone
                pending += chunk
            else:
                idle()


if __name__ == "__main__":
    _serve()
