"""Engine integrations: adapters that prepare an engine's KV caches for kvlayout.

Integrations use the core (formats, specs, detection, transfer) and never patch it.
Each is imported on its own (``kvlayout.integrations.vllm``), so the engine it adapts
stays an optional dependency.
"""
