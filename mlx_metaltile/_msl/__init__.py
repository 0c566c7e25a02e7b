"""The MSL core shared by the executors that run ``mx.fast.metal_kernel`` bodies without Metal.

* ``signature``: the kernel source MLX generates around a body;
* ``source``: the line-preserving rewrites (threadgroup declarations, half/bfloat literals);
* ``builtins``: the MSL built-in attributes and how each executor provides them;
* ``dtypes``: the dtypes and their MSL, CUDA and NumPy spellings;
* ``kernel``: ``MetalKernel``, the base class with MLX's argument checks and messages;
* ``capabilities``: MSL features an executor refuses, with one message.

``mlx_metaltile.emulator`` and ``mlx_metaltile.cuda`` are executors over it.
"""
