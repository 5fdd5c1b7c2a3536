"""Independent reference implementations (transformers / PyTorch) used by tests and benchmarks; torch is
imported lazily, so importing glm53 never needs it."""
