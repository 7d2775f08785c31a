"""``impl="triton"``: fused Triton kernels for the softplus-l1 family.

:mod:`lssar.ops.triton.kernels` is the device code (jitted kernels and their device functions),
:mod:`lssar.ops.triton.autotune` their autotuning (configurations, pruning, autotuned launchers),
:mod:`lssar.ops.triton.decode` the split-K decode kernels, :mod:`lssar.ops.triton.host` the host
code (launches, custom ops, :func:`triton_attention`). Developer tools (compile check, SASS
reader, cost model) are :mod:`lssar.ops.triton.devtools`, which the kernels never import.
Nothing is imported here, so the registry can list the implementation without importing triton.
"""
