"""Where restored bytes live, and how they get there: the only code that knows the CPU,
Apple's unified memory or a CUDA GPU.

`target` decides once per handle where a restore's buffers are made (`Target`, passed
explicitly to whoever reads); `buffers` allocates them (MLX arrays without a zero-fill,
host bits, a fill's `Arena`) and joins RAM-tier blocks with MLX operations on a GPU;
`readers` holds the threads that fill them; `cuda` moves what the host wrote onto a
CUDA GPU and copies new KV off it (the CUDA driver, through ``ctypes``).

It imports nothing of the package but the block vocabulary (`blocks`): the storage
(`disk/`) and the core ask it, never the other way round.
"""
