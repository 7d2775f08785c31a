"""SASS of a compiled Triton kernel: instructions, their classes, the innermost loops.

Reads a cubin with the ``cuobjdump`` that ships in the ``triton`` wheel (no GPU, no CUDA toolkit
needed). Used by :mod:`lssar.ops.triton.devtools.compile_check` (tensor-core instructions,
spills) and :mod:`lssar.ops.triton.devtools.cost` (instructions per score in the inner loops).
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton

_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# an instruction line of `cuobjdump -sass`: /*0a30*/  @!P0 HGMMA.64x64x16.F32.BF16 ...
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)")
_BRA_TARGET = re.compile(r"BRA\s+(?:`\()?\s*(0x[0-9a-f]+)")


def sass(cubin: bytes) -> list[tuple[int, str, int | None]]:
    """``(address, opcode with modifiers, branch target or None)`` of every instruction in a cubin
    (``cuobjdump -sass``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(_TOOLS / "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    out = []
    for line in text.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            tgt = _BRA_TARGET.search(line) if m[2].startswith("BRA") else None
            out.append((int(m[1], 16), m[2], int(tgt[1], 16) if tgt else None))
    return out


# HMMA shapes (m, n, k) by their SASS spelling (one warp's product)
_HMMA_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "1684": (16, 8, 4)}
_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")


def mma_flop(op: str) -> float:
    """Tensor-core FLOP one warp's execution of ``op`` contributes (0 for other instructions).

    ``HGMMA.MxNxK``: a warpgroup (4 warps) multiplies an ``M x N x K`` product, ``2MNK / 4`` per
    warp; ``HMMA.mnk``: one warp's ``m x n x k`` product, ``2mnk``. An MMA shape this table does
    not know raises (a silent 0 would understate the tensor time)."""
    m = _HGMMA_SHAPE.match(op)
    if m:
        return 2.0 * int(m[1]) * int(m[2]) * int(m[3]) / 4
    if op.startswith("HMMA."):
        shape = _HMMA_SHAPES.get(op.split(".")[1])
        if shape is None:
            raise ValueError(f"unknown HMMA shape in {op!r}: add it to sass._HMMA_SHAPES")
        return 2.0 * shape[0] * shape[1] * shape[2]
    return 0.0


def opcode_counts(instrs: list[tuple[int, str, int | None]]) -> dict[str, float]:
    """Counts of the instruction classes the report uses (tensor cores, MUFU, local memory,
    global atomics), every instruction but ``NOP`` (``total``: issue slots), and the tensor-core
    FLOP per warp (``flop``, :func:`mma_flop`)."""
    ops = [op for _, op, _ in instrs]
    return {
        "hgmma": sum(op.startswith("HGMMA") for op in ops),
        "hmma": sum(op.startswith("HMMA") for op in ops),
        "ex2": sum(op.startswith("MUFU.EX2") for op in ops),
        "lg2": sum(op.startswith("MUFU.LG2") for op in ops),
        "rcp": sum(op.startswith("MUFU.RCP") for op in ops),
        "mufu": sum(op.startswith("MUFU") for op in ops),
        "atomic": sum(op.startswith(("RED", "ATOM")) for op in ops),
        "local": sum(op.startswith(("STL", "LDL")) for op in ops),
        "total": sum(op != "NOP" for op in ops),
        "flop": sum(map(mma_flop, ops)),
    }


def innermost_loops(instrs: list[tuple[int, str, int | None]]) -> list[tuple[int, int]]:
    """Address ranges ``[start, end]`` of the innermost loops, in address order: a backward
    branch closes a loop that starts at its target; a loop containing another loop is not
    innermost. Triton's software pipelining leaves the steady state of each ``for`` over key /
    query blocks here (in source order: the cost model relies on it, see
    :mod:`lssar.ops.triton.devtools.cost`)."""
    loops = sorted({(t, a) for a, _, t in instrs if t is not None and t < a})
    return [
        (s, e)
        for s, e in loops
        if not any((s, e) != (s2, e2) and s <= s2 and e2 <= e for s2, e2 in loops)
    ]


def loop_counts(instrs: list[tuple[int, str, int | None]]) -> dict:
    """:func:`opcode_counts` of the instructions inside the innermost loops (one iteration of
    each: the static cost of one tile of scores per loop), summed, plus how many such loops there
    are (``loops``) and each loop's own counts in address order (``each``)."""
    loops = innermost_loops(instrs)
    each = [opcode_counts([i for i in instrs if s <= i[0] <= e]) for s, e in loops]
    body = [i for i in instrs if any(s <= i[0] <= e for s, e in loops)]
    return {"loops": len(loops), **opcode_counts(body), "each": each}
