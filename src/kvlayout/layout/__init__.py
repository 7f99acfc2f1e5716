"""The layout layer: a format name read as a layout, and everything a layout implies.

``vocabulary`` (what each token means, vLLM's ``kv_layout`` spellings), ``parser`` (a
name -> ``ast.Layout``), ``ast`` (the Layout and its facts), ``algebra`` (roles, sizes,
strides, offsets, copy plans), ``formats`` (a format given as enum, value or name -> its
Layout), ``description`` (a layout as plain data for tools) and ``dtypes`` (element
types by name, with their sizes).

It knows tokens, roles, axes, list levels, sizes and strides, and the generated tables
of ``layouts.yaml`` it is read from (``_generated.vocabulary``, ``_generated.formats``).
It must not know torch, tensors or engines, nor import any layer above it: every other
layer asks it by role, never by token name.
"""
