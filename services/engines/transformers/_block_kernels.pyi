# The C extension _block_kernels.c (pointers are torch data_ptr() integers).
def q4_1_linear(
    x: int, rows: int, k: int, qs: int, d: int, m: int, n: int, y: int, threads: int, /
) -> None: ...
def q8_0_linear(
    x: int, rows: int, k: int, qs: int, d: int, n: int, y: int, threads: int, /
) -> None: ...
def q4_1_dequant(qs: int, d: int, m: int, n: int, k: int, w: int, threads: int, /) -> None: ...
def q8_0_dequant(qs: int, d: int, n: int, k: int, w: int, threads: int, /) -> None: ...
def simd() -> str: ...
def add_rms_norm(
    h: int, delta: int, rows: int, n: int, weight: int, eps: float, out: int, threads: int, /
) -> None: ...
def silu_mul(gate_up: int, rows: int, inter: int, out: int, threads: int, /) -> None: ...
def rotary(
    x: int, rows: int, width: int, heads: int, dim: int, cos: int, sin: int, threads: int, /
) -> None: ...
def attend_one(
    q: int,
    q_row: int,
    q_head: int,
    keys: int,
    values: int,
    kv_row: int,
    kv_head: int,
    mask: int,
    mask_row: int,
    rows: int,
    heads: int,
    kv_heads: int,
    columns: int,
    dim: int,
    scale: float,
    out: int,
    threads: int,
    /,
) -> None: ...
