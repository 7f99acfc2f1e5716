"""kvlayout's tests, laid out like the package: ``layout/`` (parser, algebra, golden
tables, descriptions), ``catalog/`` (codegen and adding a format), ``registration/``
(memory order, bound registrations), ``detection/`` (engine detectors, indexer caches),
``transfer/`` (plans, native and CUDA copies), ``integrations/vllm/`` (the group edits
against vLLM's own classes), ``tools/`` (CLI, demo), and at the top the docs, the facade,
the layer check and the cross-cutting hardening and fuzz suites."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
