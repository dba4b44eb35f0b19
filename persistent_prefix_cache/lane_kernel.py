"""The fingerprint's lane sums in one CUDA kernel a weight (`weights_hash` owns the scheme).

It sits in the base beside `weights_hash`, for the same reason: it fingerprints the
weights where they live and places no bytes (docs/architecture.md, rule 10).

With MLX ops a weight's lane sums take a buffer of terms 16 bytes a word (one per lane),
then a reduction: GBs of temporaries for an 8B model, which the open then hands back with
`mx.clear_cache()`, so the first forward after an open allocated every buffer anew
(docs/performance.md). This kernel reads each word once, keeps a thread's four lane sums
in registers, adds a block's together in shared memory and adds those into the weight's
chunk sums with atomics: nothing but the sums (16 bytes a chunk) is allocated. Sums mod
2**32 are the same in any order, so the value is the same as the MLX ops'.

It is PTX, run by `mx.fast.precompiled_cuda_kernel`: CUDA C through `mx.fast.cuda_kernel`
is compiled by NVRTC in every new process (1.6-2.2 s on an H100, `device/cuda.py` says
why), PTX is compiled once per host by the driver, which keeps it.

Launch: threadgroups of `THREADS` threads, each thread `ITEMS` words `THREADS` apart, so a
threadgroup's words (`BLOCK_WORDS`) are contiguous and inside one chunk (chunks are a
power of two words, at least `BLOCK_WORDS`). The weight's address may be unaligned (a view
into a larger buffer): then each word is read as four bytes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

THREADS = 256
ITEMS = 64
BLOCK_WORDS = THREADS * ITEMS
_MAX_WORDS = (1 << 31) - BLOCK_WORDS  # the word count is a 32-bit int (MLX passes ints as int32)


def _lane(p: int, q: int, m1: int, m2: int, acc: str) -> str:
    # One lane's term of word %r14 at position %r9 (see weights_hash's module docstring),
    # added into `acc`; every operation wraps mod 2**32.
    return f"""
    mul.lo.u32 %r18, %r9, 0x{p:08X}U;
    add.u32 %r18, %r18, 0x{q:08X}U;
    xor.b32 %r18, %r18, %r14;
    mul.lo.u32 %r18, %r18, 0x{m1:08X}U;
    shr.u32 %r19, %r18, 15;
    xor.b32 %r18, %r18, %r19;
    mul.lo.u32 %r18, %r18, 0x{m2:08X}U;
    shr.u32 %r19, %r18, 13;
    xor.b32 %r18, %r18, %r19;
    add.u32 {acc}, {acc}, %r18;"""


_ACCS = ("%r10", "%r11", "%r12", "%r13")


@lru_cache(maxsize=4)
def ptx(p: Sequence[int], q: Sequence[int], m1: int, m2: Sequence[int]) -> bytes:
    """The kernel ``ppc_lanes(words, out, n, shift)`` for four lanes' constants: the lane
    sums of `n` 32-bit words added into ``out[(i >> shift) * 4 + lane]``."""
    terms = "".join(_lane(p[k], q[k], m1, m2[k], _ACCS[k]) for k in range(4))
    butterfly = "".join(
        f"""
    shfl.sync.bfly.b32 %r20, {acc}, {off}, 31, -1;
    add.u32 {acc}, {acc}, %r20;"""
        for acc in _ACCS
        for off in (16, 8, 4, 2, 1)
    )
    return f"""
.version 6.3
.target sm_75
.address_size 64
.visible .entry ppc_lanes(.param .u64 ppc_lanes_w, .param .u64 ppc_lanes_out, .param .u32 ppc_lanes_n,
                          .param .u32 ppc_lanes_shift)
{{
    .reg .pred %p<6>;
    .reg .b16 %h<5>;
    .reg .b32 %r<32>;
    .reg .b64 %rd<12>;
    .shared .align 16 .b32 ppc_red[128];

    ld.param.u64 %rd1, [ppc_lanes_w];
    ld.param.u64 %rd2, [ppc_lanes_out];
    ld.param.u32 %r1, [ppc_lanes_n];
    ld.param.u32 %r2, [ppc_lanes_shift];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mul.lo.u32 %r6, %r5, {ITEMS};
    mul.lo.u32 %r7, %r4, %r6;
    add.u32 %r8, %r7, %r6;
    min.u32 %r8, %r8, %r1;
    add.u32 %r9, %r7, %r3;
    mov.u32 %r10, 0;
    mov.u32 %r11, 0;
    mov.u32 %r12, 0;
    mov.u32 %r13, 0;
    and.b64 %rd3, %rd1, 3;
    setp.ne.u64 %p2, %rd3, 0;
$L_loop:
    setp.ge.u32 %p1, %r9, %r8;
    @%p1 bra $L_done;
    mul.wide.u32 %rd4, %r9, 4;
    add.u64 %rd5, %rd1, %rd4;
    @%p2 bra $L_bytes;
    ld.global.nc.u32 %r14, [%rd5];
    bra $L_word;
$L_bytes:
    ld.global.nc.u8 %h1, [%rd5];
    ld.global.nc.u8 %h2, [%rd5+1];
    ld.global.nc.u8 %h3, [%rd5+2];
    ld.global.nc.u8 %h4, [%rd5+3];
    cvt.u32.u16 %r14, %h1;
    cvt.u32.u16 %r15, %h2;
    cvt.u32.u16 %r16, %h3;
    cvt.u32.u16 %r17, %h4;
    shl.b32 %r15, %r15, 8;
    shl.b32 %r16, %r16, 16;
    shl.b32 %r17, %r17, 24;
    or.b32 %r14, %r14, %r15;
    or.b32 %r14, %r14, %r16;
    or.b32 %r14, %r14, %r17;
$L_word:{terms}
    add.u32 %r9, %r9, %r5;
    bra $L_loop;
$L_done:{butterfly}
    and.b32 %r21, %r3, 31;
    shr.u32 %r22, %r3, 5;
    setp.ne.u32 %p3, %r21, 0;
    mov.u64 %rd6, ppc_red;
    mul.wide.u32 %rd7, %r22, 16;
    add.u64 %rd7, %rd6, %rd7;
    @!%p3 st.shared.u32 [%rd7], %r10;
    @!%p3 st.shared.u32 [%rd7+4], %r11;
    @!%p3 st.shared.u32 [%rd7+8], %r12;
    @!%p3 st.shared.u32 [%rd7+12], %r13;
    bar.sync 0;
    setp.ne.u32 %p4, %r3, 0;
    @%p4 bra $L_end;
    add.u32 %r23, %r5, 31;
    shr.u32 %r23, %r23, 5;
    mov.u32 %r10, 0;
    mov.u32 %r11, 0;
    mov.u32 %r12, 0;
    mov.u32 %r13, 0;
    mov.u32 %r24, 0;
    mov.u64 %rd8, %rd6;
$L_sum:
    setp.ge.u32 %p5, %r24, %r23;
    @%p5 bra $L_out;
    ld.shared.u32 %r25, [%rd8];
    add.u32 %r10, %r10, %r25;
    ld.shared.u32 %r25, [%rd8+4];
    add.u32 %r11, %r11, %r25;
    ld.shared.u32 %r25, [%rd8+8];
    add.u32 %r12, %r12, %r25;
    ld.shared.u32 %r25, [%rd8+12];
    add.u32 %r13, %r13, %r25;
    add.u64 %rd8, %rd8, 16;
    add.u32 %r24, %r24, 1;
    bra $L_sum;
$L_out:
    shr.u32 %r26, %r7, %r2;
    mul.wide.u32 %rd9, %r26, 16;
    add.u64 %rd9, %rd2, %rd9;
    red.global.add.u32 [%rd9], %r10;
    red.global.add.u32 [%rd9+4], %r11;
    red.global.add.u32 [%rd9+8], %r12;
    red.global.add.u32 [%rd9+12], %r13;
$L_end:
    ret;
}}
""".encode()


def runs_here() -> bool:
    """Whether this MLX can run PTX and its default device is a CUDA GPU (not Metal)."""
    import mlx.core as mx

    return hasattr(mx.fast, "precompiled_cuda_kernel") and mx.default_device() == mx.gpu and not mx.metal.is_available()


def fits(nbytes: int, chunk_words: int) -> bool:
    """Whether the kernel takes a weight of `nbytes` bytes in chunks of `chunk_words`
    words: whole words (a padded last word is left to MLX ops), a count that fits its
    32-bit int, and chunks of a power of two words that hold whole threadgroups."""
    return (
        nbytes > 0
        and nbytes % 4 == 0
        and nbytes // 4 <= _MAX_WORDS
        and chunk_words >= BLOCK_WORDS
        and chunk_words & (chunk_words - 1) == 0
    )


def lane_sums(value, chunk_words: int, source: bytes):
    """A lazy ``uint32`` array of the weight's lane sums, four a chunk (`fits` must hold).

    Args:
        value: An MLX array on a CUDA GPU (any dtype; its bytes are what is summed).
        chunk_words: Words a chunk (a power of two, at least `BLOCK_WORDS`).
        source: `ptx` for the lane constants.
    """
    import mlx.core as mx

    n = value.nbytes // 4
    chunks = -(-n // chunk_words)
    blocks = -(-n // BLOCK_WORDS)
    return mx.fast.precompiled_cuda_kernel(
        name="ppc_lanes", compiled_source=source, inputs=[value], output_shapes=[(chunks * 4,)],
        output_dtypes=[mx.uint32], scalars=[n, chunk_words.bit_length() - 1], grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1), init_value=0.0, ensure_row_contiguous=True,
    )[0]  # fmt: skip
