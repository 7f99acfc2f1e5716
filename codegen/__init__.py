"""The kvlayout code generator: layouts.yaml -> Python specs, C++ headers, docs."""
