"""Engine integrations: adapters that prepare an engine's KV caches for kvlayout.

Integrations use the core (formats, specs, detection, the facade) and never patch it;
the core must not import an integration, and an integration must not know another
engine's.
Each is imported on its own (``kvlayout.integrations.vllm``), so the engine it adapts
stays an optional dependency.
"""
