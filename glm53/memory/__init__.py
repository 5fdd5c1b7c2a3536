"""The per-device memory budget of the real model: parameter inventory and cache pytree (`inventory`), named
placements by the sharding rules (`placement`), bytes of weights (`weights`) and caches (`caches`), the budget
(`budget`), the prior art it is compared with (`prior_art`) and its tables (`report`)."""
