"""Routed-expert computation (grouped expert matmuls + weighted combine)."""

from kernels.moe.api import IMPLEMENTATIONS, clamped_swiglu, moe_experts

__all__ = ["IMPLEMENTATIONS", "moe_experts", "clamped_swiglu"]
