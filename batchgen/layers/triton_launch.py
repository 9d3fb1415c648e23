"""Triton launches without the JIT's per-launch bookkeeping, for the kernels an eager forward launches by the hundred.

`kernel[grid](...)` spends tens of microseconds of host time before Triton's launcher runs: binding the arguments,
specializing each, keying the in-memory cache, checking the globals the kernel read. An eager prefill step of a
28-layer model launches about 140 Triton kernels, and on a slow host its launches rather than the device set the
step's pace. `DirectKernel(kernel)[grid](...)` launches through Triton the first time it meets a
specialization, keeps the compiled kernel that launch returns, and from then on calls that kernel's launcher itself.

The key a compiled kernel is kept under tells apart at least what Triton specializes on: each tensor's dtype and
16-byte alignment; each integer's type range, equality to 1 and divisibility by 16; the keyword arguments' values
(constexprs and launch options); the device. Triton's own launch runs instead whenever a hook watches compiles or
launches (compile_ahead's dry run sets one; so do Triton's profilers), and for good once a direct call is refused
(a Triton whose launcher takes other arguments).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

try:
    from triton.compiler.compiler import CompiledKernel
except ImportError:  # a Triton without it: every launch goes through the JIT
    CompiledKernel = ()  # an isinstance check against it is False

_refused = CompiledKernel == ()  # a direct call failed once: Triton's launcher takes other arguments


def _hooked() -> bool:
    """Whether something watches Triton's compiles or launches (a hook chain with calls, or a hook function)."""
    runtime = knobs.runtime
    if runtime.jit_cache_hook is not None:
        return True
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -0x80000000 <= value <= 0x7FFFFFFF, 0 <= value < 0x8000000000000000
    return type(value)


class DirectKernel:
    """A JIT kernel launched as `direct_kernel[grid](*args, **kwargs)`, as the kernel itself would be: positional
    arguments first, then every later parameter (or its default) and the launch options by keyword."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.interpreted = not isinstance(kernel, JITFunction)  # TRITON_INTERPRET=1: no driver, nothing compiled
        parameters = list(inspect.signature(kernel.fn).parameters.values())
        self._parameters = [(p.name, p.default) for p in parameters]
        self._compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        global _refused
        if self.interpreted:
            self.kernel[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        key = (device, *map(_arg_key, args), *kwargs.values())
        compiled = self._compiled.get(key)
        if compiled is not None and not _refused and not _hooked():
            # The launcher takes every parameter in order, constexprs too (it skips them), as the JIT passes them.
            later = self._parameters[len(args):]
            values = [*args, *(kwargs.get(name, default) for name, default in later)]
            grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
            stream = driver.active.get_current_stream(device)
            try:  # no launch metadata and no hooks: none are set (_hooked)
                compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None,
                             None, *values)
                return
            except TypeError:
                _refused = True  # the launcher's arguments differ in this Triton: it refused before launching
        launched = self.kernel[grid](*args, **kwargs)
        if isinstance(launched, CompiledKernel) and not _hooked():
            self._compiled[key] = launched
