"""Send a request's block map between processes through NIXL: kvlayout computes and
registers, NIXL moves the bytes (nothing of NIXL is re-implemented here).

A map is read through :class:`NixlMap` (its byte runs and its two sides, each a
:class:`MapSide`): exactly one side lives in this process (a registration), the other is
a peer's description. A :class:`~kvlayout.transfer.block_maps.BlockMap` between a live
registration and a peer's :class:`~kvlayout.registration.peers.RegistrationDescription`
is one as it is (its sides answer ``is_local``, ``device_type``, ``device_index`` and
``tensor_spans``). From it come, for ``nixl_agent.get_xfer_descs``, the local and
remote ``(N, 3)`` descriptor arrays (address, length, device id) and the op: ``"WRITE"``
when the local side is the source, ``"READ"`` when it is the destination.

- :func:`register` registers each distinct storage of a registration once (layers that
  share memory, or slices of one pool, are one region), as DRAM or VRAM by its device
  (``regions``, with the checks that every descriptor lies where it may).
- :func:`descriptors` is the direct form (``direct``); :func:`prep_lists` the prepped
  one (``prepped``: both sides prepared once, at the handshake, as NIXL lists of
  fixed-size units; each request then passes index arrays, and NIXL merges consecutive
  dense indices back into long descriptors).
- Three strategies (``plans``): ``"direct"`` posts the map's runs; ``"staged"`` gathers
  the request into a registered :class:`Staging` buffer (``copies``) laid out as the
  remote side's runs (one stretch per run of remote-consecutive runs) and posts one
  descriptor per stretch (for a READ, the mirror: receive into staging, then scatter);
  ``"peer-staged"`` moves the runs as they lie here to or from the peer's staging
  buffer, the peer doing the copy (``peer_staging``: :func:`stage`, :func:`unstage`,
  paced by notifications when in stages). :class:`CostModel` (defaults from this
  machine's measurements, or :func:`calibrate` on the live pair: ``calibration``) picks
  one per request; the caller can force any.
- :func:`transfer` (``posting``) validates every descriptor before anything is posted
  (local ones inside regions registered on this agent, remote ones inside the peer's
  described tensors and, for the list form, inside what the peer registered with NIXL),
  then posts; :meth:`Transfer.wait` (or :func:`wait`) raises on NIXL's ``"ERR"`` or a
  timeout. :func:`prepare_transfer` does all but the posting ahead (the plan, the
  checks, the NIXL requests), and :meth:`Transfer.start` posts.
- What a request, buffer or list holds is let go of when it is waited for, released or
  closed; what an object dropped on another thread held is left to the agent's next
  call, and :func:`drain` does it (at shutdown, before the agent is dropped).

The modules import downward in that order: ``sides`` (what a map offers, the errors),
``regions``, ``direct``, ``copies``, ``plans``, ``peer_staging``, ``prepped``,
``holds`` (what a request holds until released), ``posting``, ``calibration``; this
package re-exports their public names.

Nothing here imports NIXL: the caller's agent is the only NIXL object used, so code that
does not move KV through NIXL never loads it (:func:`make_agent` imports it on call).
"""

from __future__ import annotations

from kvlayout.transfer.nixl.calibration import SyncMode, calibrate, make_agent
from kvlayout.transfer.nixl.copies import Staging, copy_byte_runs
from kvlayout.transfer.nixl.direct import Descriptors, descriptors
from kvlayout.transfer.nixl.holds import drain
from kvlayout.transfer.nixl.peer_staging import (
    PeerCopy,
    StageNotifs,
    prepare_stage,
    prepare_unstage,
    stage,
    stage_notif,
    take_notif,
    unstage,
)
from kvlayout.transfer.nixl.plans import (
    AUTO_STAGES,
    DEFAULT_COST,
    DEFAULT_READ_COST,
    CostModel,
    Estimate,
    PeerStaging,
    Plan,
    Stage,
    auto_stages,
    default_cost,
    estimate,
    plan,
)
from kvlayout.transfer.nixl.posting import Transfer, TransferResult, prepare_transfer, transfer, wait
from kvlayout.transfer.nixl.prepped import Prepped, PreppedList, prep_lists
from kvlayout.transfer.nixl.regions import Registered, register
from kvlayout.transfer.nixl.sides import (
    Agent,
    LocalSide,
    MapSide,
    NixlError,
    NixlMap,
    NixlTimeoutError,
    Op,
    RefusedDescriptorError,
    Strategy,
    local_side,
)

__all__ = [
    "AUTO_STAGES",
    "DEFAULT_COST",
    "DEFAULT_READ_COST",
    "Agent",
    "CostModel",
    "Descriptors",
    "Estimate",
    "LocalSide",
    "MapSide",
    "NixlError",
    "NixlMap",
    "NixlTimeoutError",
    "Op",
    "PeerCopy",
    "PeerStaging",
    "Plan",
    "Prepped",
    "PreppedList",
    "RefusedDescriptorError",
    "Registered",
    "Stage",
    "StageNotifs",
    "Staging",
    "Strategy",
    "SyncMode",
    "Transfer",
    "TransferResult",
    "auto_stages",
    "calibrate",
    "copy_byte_runs",
    "default_cost",
    "descriptors",
    "drain",
    "estimate",
    "local_side",
    "make_agent",
    "plan",
    "prep_lists",
    "prepare_stage",
    "prepare_transfer",
    "prepare_unstage",
    "register",
    "stage",
    "stage_notif",
    "take_notif",
    "transfer",
    "unstage",
    "wait",
]
