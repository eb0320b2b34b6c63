"""Tensor kernels. Each has a reference torch implementation; `attention` also has a flash backend."""
