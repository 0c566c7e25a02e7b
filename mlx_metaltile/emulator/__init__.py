"""The MSL CPU emulator: runs ``mx.fast.metal_kernel`` bodies on machines without Metal.

``metal_kernel(...)`` takes exactly what ``mx.fast.metal_kernel`` takes and returns a callable
with the same call signature and result; the kernel is compiled with the host C++ compiler
against the emulator's MSL runtime headers and run on the CPU (eagerly). A kernel that breaks
a Metal rule raises a ``KernelHazard`` naming the kernel, the threadgroup, the thread and the
source line. See README.md next to this file.
"""

from ._errors import (
    ArithmeticFault,
    BarrierDivergence,
    EmulatorError,
    InputBufferWrite,
    InvalidSimdLane,
    KernelCompileError,
    KernelHazard,
    KernelTimeout,
    MemoryFault,
    OutOfBoundsAccess,
    SimdgroupMatrixHazard,
    StackOverflow,
    ThreadgroupMemoryExceeded,
    ThreadgroupRace,
    UninitializedThreadgroupRead,
)
from ._kernel import EmulatedKernel, LaunchStats, last_launch_stats, metal_kernel
from ._settings import Settings, configure, settings
from ._toolchain import unavailable_reason

__all__ = [
    "ArithmeticFault",
    "BarrierDivergence",
    "EmulatedKernel",
    "EmulatorError",
    "InputBufferWrite",
    "InvalidSimdLane",
    "KernelCompileError",
    "KernelHazard",
    "KernelTimeout",
    "LaunchStats",
    "MemoryFault",
    "OutOfBoundsAccess",
    "Settings",
    "SimdgroupMatrixHazard",
    "StackOverflow",
    "ThreadgroupMemoryExceeded",
    "ThreadgroupRace",
    "UninitializedThreadgroupRead",
    "configure",
    "last_launch_stats",
    "metal_kernel",
    "settings",
    "unavailable_reason",
]
