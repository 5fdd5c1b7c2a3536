"""mHC (manifold-constrained hyper-connections): stream collapse / mixing weights and the stream update."""

from kernels.mhc.api import IMPLEMENTATIONS, mhc_post, mhc_pre

__all__ = ["IMPLEMENTATIONS", "mhc_pre", "mhc_post"]
