"""The runtime: the device programs every decode path runs (`glm53.runtime.programs.Programs`, plain or speculative),
decode-time weight preparation (`glm53.runtime.weights`), slot operations on caches (`glm53.runtime.cache`) and
sampling with its parameter checks (`glm53.runtime.sampling`). The serving engine (glm53.serving.engine) drives
it; `glm53.serving.offline.generate` is its synchronous front (prompts in, tokens out)."""
