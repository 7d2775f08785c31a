"""Developer tools for the Triton kernels, not part of ``impl="triton"``: the kernels
(:mod:`lssar.ops.triton.kernels`, ``autotune``, ``decode``, ``host``) never import them.

:mod:`~lssar.ops.triton.devtools.compile_check` compiles every kernel x constexpr x config for
real GPUs (sm_80, sm_90) without one and reads registers, spills and shared memory;
:mod:`~lssar.ops.triton.devtools.sass` reads the compiled SASS (opcode and loop counts);
:mod:`~lssar.ops.triton.devtools.cost` is the static cost model built on both. Commands:
``python -m lssar.ops.triton.devtools.compile_check`` and ``python -m
lssar.ops.triton.devtools.cost`` (their old names ``lssar.ops.triton.compile_check`` and
``lssar.ops.triton.cost`` still run them).
"""
