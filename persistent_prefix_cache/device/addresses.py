"""Where MLX arrays' bytes sit in CUDA device memory, read without moving them.

The host asking for an MLX array's address (a memoryview) makes MLX move a device
buffer into managed memory first. A kernel is given the address as it is: a one-thread
kernel writes it out, and copies by the copy engine (a restore's stages, a writer's copy
to the host: `cuda`) go straight there or from there.
"""

from __future__ import annotations

from typing import Sequence, cast

import numpy as np

from . import cuda

# A kernel that writes where its input's bytes are: MLX hands a kernel an array's device
# address as it is, where the host asking for it moves the buffer (below). Written in PTX,
# which the driver compiles in a moment: the same kernel in CUDA C went through MLX's
# runtime compiler, 1.6-2.2 s in every new process (H100; MLX keeps no such kernel on disk).
_ADDRESS_PTX = b"""
.version 6.3
.target sm_75
.address_size 64
.visible .entry ppc_address(.param .u64 ppc_address_a, .param .u64 ppc_address_out)
{
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [ppc_address_a];
    ld.param.u64 %rd2, [ppc_address_out];
    cvta.to.global.u64 %rd3, %rd2;
    st.global.u64 [%rd3], %rd1;
    ret;
}
"""
_addresses_work = True  # cleared for the process where MLX cannot run the kernel
_addresses_checked = False  # set once the first call has checked the route end to end
_CHECK_WORDS = 1024  # words of the check's array


def _address_kernels(arrays: Sequence) -> list:
    """One lazy ``uint64`` array per MLX array: its address, written by a one-thread kernel."""
    import mlx.core as mx

    return [
        mx.fast.precompiled_cuda_kernel(
            name="ppc_address", compiled_source=_ADDRESS_PTX, inputs=[a], output_shapes=[(1,)],
            output_dtypes=[mx.uint64], scalars=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
        )[0]
        for a in arrays
    ]  # fmt: skip


def _addresses_read_back() -> bool:
    """Whether the bytes at the address the kernel gives for a device array are that
    array's, as the driver reads them: every copy by address (a restore's, a writer's)
    trusts the kernel's parameter layout and the driver alike, so the first call checks
    both, once per process, on an array computed on the device."""
    import mlx.core as mx

    driver = cuda._get_driver()
    if driver is None:
        return False
    mult = 2654435761  # distinct words, none zero but the first
    x = mx.arange(_CHECK_WORDS, dtype=mx.uint32) * mult
    want = np.arange(_CHECK_WORDS, dtype=np.uint32) * np.uint32(mult)
    (out,) = _address_kernels([x])
    mx.eval(out)
    got = np.zeros(_CHECK_WORDS, dtype=np.uint32)
    try:
        driver.read(got.ctypes.data, int(cast(int, out.item())), got.nbytes)
    except OSError:
        return False
    return bool(np.array_equal(got, want))


def device_addresses(arrays: Sequence) -> list[int] | None:
    """Where evaluated MLX arrays' bytes sit in device memory, each read by a one-thread
    kernel given the array, so that copies (a restore's, a writer's) can go straight
    there or from there.

    The host asking for an MLX array's address (a memoryview) makes MLX move a device
    buffer into managed memory first: a new managed block and a synchronous copy of the
    whole buffer, 145-149 ms for the 64 buffers of a 16k-token restore of an 8B llama on
    an H100 (``tools/first_restore.py +phases``, docs/performance.md). A kernel is given
    the address as it is. The process's first call checks, once, that the driver reads
    an array's own bytes at the address given (`_addresses_read_back`).

    Args:
        arrays: Contiguous MLX arrays on the GPU, each owning its buffer (or a view of
            one from its start); lazy ones are evaluated in the same evaluation as their
            addresses.

    Returns:
        One address per array, or None where this MLX cannot run a precompiled CUDA
        kernel or the check failed (then for the process: the caller takes host views).
    """
    global _addresses_work, _addresses_checked
    import mlx.core as mx

    if not _addresses_work:
        return None
    try:
        if not _addresses_checked:
            _addresses_checked = True
            if not _addresses_read_back():
                _addresses_work = False
                return None
        outs = _address_kernels(arrays)
        mx.eval(outs)
        return [int(cast(int, x.item())) for x in outs]
    except (AttributeError, RuntimeError, ValueError, TypeError):  # an MLX without the call, a refused module or launch
        _addresses_work = False
        return None
