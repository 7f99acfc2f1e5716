"""kvlayout's tests, laid out like the package: ``layout/`` (parser, algebra, golden
tables, descriptions), ``catalog/`` (codegen and adding a format), ``detection/`` (engine
detectors, memory order, bound registrations), ``transfer/`` (plans, native and CUDA
copies), ``integrations/vllm/`` (the group edits against vLLM's own classes), and at the
top the user-facing surfaces (CLI, demo, docs, facade) and the cross-cutting hardening
and fuzz suites."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
