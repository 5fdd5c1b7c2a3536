"""Routed-expert computation (grouped expert matmuls + weighted combine)."""

from kernels.moe.api import clamped_swiglu, moe_experts

__all__ = ["moe_experts", "clamped_swiglu"]
