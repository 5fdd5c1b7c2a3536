"""Few-row f32 matmuls on the CPU (decode steps): a C++ `jax.ffi` kernel that streams the weights once
(cpu_ffi.py, csrc/rowmm.cc) and `StreamedKernel`, the weight wrapper decode programs use it through."""
