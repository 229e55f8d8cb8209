"""The engine: model + KV pool + attention backend + sampler (+ CUDA graphs), in `engine.engine`.

This package's top level imports nothing, so that `engine.context`, which the layers read, can be
imported below the engine."""
