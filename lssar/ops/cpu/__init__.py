"""``impl="cpu"``'s fused C++ kernel: its source (``softplus_attention.cpp``) and
:mod:`lssar.ops.cpu.build`, which compiles it once per environment into torch's extensions cache
and loads it (``python -m lssar.ops.cpu.build`` builds it ahead of time: ``make setup``). The
host code that calls it is :mod:`lssar.ops.chunked` (forward, backward) and
:mod:`lssar.ops.decode` (a decode step). Nothing is imported here.
"""
