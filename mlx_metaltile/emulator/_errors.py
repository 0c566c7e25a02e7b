"""Exceptions raised by the emulator: one base class, one subclass per hazard."""

from __future__ import annotations


class EmulatorError(RuntimeError):
    """The emulator itself cannot run (no compiler, cannot map memory, ...)."""


class KernelHazard(RuntimeError):
    """A kernel broke a Metal rule (or would misbehave on a Mac).

    Attributes: ``kernel`` (the kernel's name), ``threadgroup`` and ``thread`` (position in
    the grid / in the threadgroup, or None when the hazard is not one thread's), ``location``
    (e.g. ``"body line 12"``, or None) and ``source_line`` (that line's text, or None).
    """

    def __init__(self, message: str, *, kernel: str = "", threadgroup=None, thread=None,
                 location: str | None = None, source_line: str | None = None):
        super().__init__(message)
        self.kernel = kernel
        self.threadgroup = threadgroup
        self.thread = thread
        self.location = location
        self.source_line = source_line


class KernelCompileError(KernelHazard):
    """The kernel source does not compile; the message is the compiler's, on the kernel's
    own lines (``body:LINE:COL`` / ``header:LINE:COL``)."""


class OutOfBoundsAccess(KernelHazard):
    """A load or store outside its device buffer, or outside every threadgroup array."""


class ThreadgroupMemoryExceeded(KernelHazard):
    """The threadgroup arrays need more than 32 KiB."""


class BarrierDivergence(KernelHazard):
    """A barrier that not every live thread reaches, or a deadlock (a Mac would hang)."""


class InvalidSimdLane(KernelHazard):
    """A SIMD-group function got a lane / delta / mask outside the SIMD-group, read a lane that
    is not active (strict mode), or ran as a converged helper (common.h) without all 32 lanes
    of its SIMD-group."""


class SimdgroupMatrixHazard(KernelHazard):
    """A simdgroup_matrix operation without all 32 lanes of a full SIMD-group."""


class UninitializedThreadgroupRead(KernelHazard):
    """Strict mode: a read of threadgroup memory that no thread has written since the
    threadgroup started (Metal does not clear threadgroup memory)."""


class StackOverflow(KernelHazard):
    """A kernel thread overflowed its stack (large per-thread arrays, recursion)."""


class MemoryFault(KernelHazard):
    """Kernel code touched memory outside every buffer of the launch (a wild pointer)."""


class ArithmeticFault(KernelHazard):
    """Integer division (or remainder) by zero in kernel code."""


class ThreadgroupRace(KernelHazard):
    """Strict mode: two threads access the same byte of threadgroup memory, at least one
    writing (not atomically), with no barrier in between: the result depends on an order a
    GPU does not define."""


class KernelTimeout(KernelHazard):
    """A launch ran past the time limit: an endless loop, or threads spin-waiting on each
    other."""


# By hazard kind: MT_HZ_<name> in include/mt_emu/launch.h.
class InputBufferWrite(KernelHazard):
    """A store into an input buffer (inputs are ``const device``; a write through a pointer
    whose const was cast away would change the caller's array on a GPU)."""


HAZARD_CLASSES = {
    "OUT_OF_BOUNDS": OutOfBoundsAccess,
    "THREADGROUP_MEMORY": ThreadgroupMemoryExceeded,
    "BARRIER": BarrierDivergence,
    "SIMD_LANE": InvalidSimdLane,
    "UNINITIALIZED_READ": UninitializedThreadgroupRead,
    "STACK_OVERFLOW": StackOverflow,
    "MEMORY_FAULT": MemoryFault,
    "ARITHMETIC": ArithmeticFault,
    "SIMDGROUP_MATRIX": SimdgroupMatrixHazard,
    "TIMEOUT": KernelTimeout,
    "RACE": ThreadgroupRace,
    "INPUT_WRITE": InputBufferWrite,
}
