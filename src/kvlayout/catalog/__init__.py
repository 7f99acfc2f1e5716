"""The catalog layer: the formats of ``layouts.yaml`` looked up.

``registry`` maps a format to its generated spec class, layout, shape strings, backend
labels and facts; ``spec`` is the base class the generated spec classes derive from
(``_generated.specs``, with ``_generated.predicates`` and ``_generated.descriptors``).

It knows formats, their layouts (from the layout layer) and the engines' labels (from
``kvlayout.types``). It must not know how an engine registers its cache, nor walk or
check a registration's tensors: that is the registration and detection layers' work.
"""
