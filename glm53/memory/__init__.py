"""The per-device memory budget of the real model: parameter inventory, budget, prior-art comparison."""
