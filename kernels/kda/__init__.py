"""KDA (Kimi Delta Attention) kernels: chunked prefill and recurrent decode, called via `kernels.kda.api`."""

from kernels.kda.api import IMPLEMENTATIONS, chunk_kda, recurrent_kda

__all__ = ["IMPLEMENTATIONS", "chunk_kda", "recurrent_kda"]
