"""mHC (manifold-constrained hyper-connections): stream collapse / mixing weights and the stream update."""

from kernels.mhc.api import mhc_post, mhc_pre

__all__ = ["mhc_pre", "mhc_post"]
