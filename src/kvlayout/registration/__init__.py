"""The registration layer: a registration's tensors read as a format's layout, checked once.

``nesting`` is the one walk of a registration's lists and tuples; ``contiguity`` the
strides and zero-copy views; ``memory`` which bytes a tensor occupies (no two tensors of
an engine group may share one); ``binding`` reads a normalized structure as a format's
layout, every tensor checked; ``kernel_groups`` the layers one kernel reads alike (their
planes, geometry and shared layers); ``registration`` is the bound ``Registration``:
per-layer formats, engine groups and kernel groups, which the facade and transfer read.
``backing`` checks that a tensor has memory behind its view; ``opaque`` reads pages
paged finer than their block as bytes; ``shards`` says which KV heads a TP rank holds
(and which replica sends them); ``peers`` is a registration as plain data (JSON, checked
as untrusted) for the other side of a transfer, and ``describing`` makes it from a bound
registration; ``address_space`` says where memory can be.

It knows formats (the catalog) and tensors; an engine is only a label it carries. It
must not know any engine's registrations or hints: which format a registration is in is
detection's answer, handed to this layer.
"""
