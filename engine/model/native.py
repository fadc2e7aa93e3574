"""Native CPU kernels: C sources compiled once with the system compiler, cached on disk, loaded with ctypes.

Why not a torch C++ extension: including torch's headers makes one compile take about a minute, while the
plain C kernel here compiles in a few seconds and needs only data pointers. ctypes releases the GIL for
the duration of a call, so the engine's overlap loop keeps planning while attention runs.

The compiled library lives in ``$ORDINAL_CACHE_DIR/kernels/`` (else ``~/.cache/ordinal/kernels/``) under a
name that hashes the source, the compiler's identity and the flags, so a changed kernel or toolchain never
loads a stale build. Set ``ORDINAL_NATIVE=0`` to force the pure torch paths (tests compare both).

Module state: the only caches are :func:`_load_paged_decode`, :func:`_load_token_bitmask`,
:func:`_load_draft_chain` and :func:`_load_panel_linear`, ``functools.cache``'d loaders, so a process compiles (or
finds) and loads each library at most once and warns at most once when it cannot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from engine.model.embedded import default_cache_dir

log = logging.getLogger(__name__)
K = TypeVar("K")  # a loaded kernel

NATIVE_ENV = "ORDINAL_NATIVE"
PAGED_DECODE_SOURCE = Path(__file__).with_name("paged_decode.c")
TOKEN_BITMASK_SOURCE = Path(__file__).with_name("token_bitmask.c")
DRAFT_CHAIN_SOURCE = Path(__file__).with_name("draft_chain.c")
PANEL_MATMUL_SOURCE = Path(__file__).with_name("panel_matmul.c")
DRAFT_CHAIN_INCLUDES = (PAGED_DECODE_SOURCE, PANEL_MATMUL_SOURCE)  # `#include`d by it: part of what names its build
# No -march=native (a cache directory may be shared between machines; the source picks ISA variants at run
# time instead) and no -ffast-math (it would drop NaN/inf semantics everywhere; the `omp simd` pragmas license
# reassociation exactly where the kernel needs it).
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
_COMPILE_TIMEOUT_S = 120.0


def native_enabled() -> bool:
    """False when ``ORDINAL_NATIVE=0``: callers then take their pure torch path. Read at every call."""
    return os.environ.get(NATIVE_ENV, "1").strip() != "0"


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: ``<ordinal cache>/kernels``."""
    return default_cache_dir() / "kernels"


@dataclass(frozen=True)
class Toolchain:
    """The C compiler used for native kernels and what identifies its output."""

    compiler: str  # absolute path
    identity: str  # first line of `--version`, e.g. "cc (Debian 12.2.0-14) 12.2.0"
    flags: tuple[str, ...]

    @classmethod
    def find(cls, flags: tuple[str, ...] = COMPILE_FLAGS) -> Toolchain | None:
        """``$CC``, else ``cc``, else ``gcc`` from PATH; None when none answers ``--version``."""
        for name in (os.environ.get("CC"), "cc", "gcc"):
            path = shutil.which(name) if name else None
            if path is None:
                continue
            try:
                done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True)
            except (OSError, subprocess.SubprocessError):
                continue
            lines = done.stdout.strip().splitlines()
            return cls(path, lines[0] if lines else "", flags)
        return None

    def library_name(self, stem: str, source: bytes) -> str:
        """``<stem>-<hash>.so``; the hash covers source, compiler identity, flags and the machine type."""
        digest = hashlib.sha256()
        for part in (source, self.compiler.encode(), self.identity.encode(), " ".join(self.flags).encode()):
            digest.update(part)
            digest.update(b"\x00")
        digest.update(platform.machine().encode())
        return f"{stem}-{digest.hexdigest()[:16]}.so"

    def compile(self, source: Path, output: Path) -> None:
        """Compile ``source`` into the shared library ``output``, atomically (a temp file, then os.replace).

        Concurrent processes may both compile; each rename is atomic and the results are identical.
        Raises RuntimeError with the compiler's message when the compile fails.
        """
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{output.stem}.", suffix=".tmp.so", dir=output.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            cmd = [self.compiler, *self.flags, "-o", str(tmp), str(source), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            tmp.chmod(0o755)
            os.replace(tmp, output)
        finally:
            tmp.unlink(missing_ok=True)


def build_library(
    stem: str, source: Path, toolchain: Toolchain, cache_dir: Path, includes: tuple[Path, ...] = ()
) -> Path:
    """The cached library for ``source``, compiling it first if this exact build is not cached yet; the files it
    ``includes`` are hashed with it, so a change to one of them is a new build too."""
    text = b"\x00".join(path.read_bytes() for path in (source, *includes))
    output = cache_dir / toolchain.library_name(stem, text)
    if not output.is_file():
        toolchain.compile(source, output)
    return output


@dataclass(frozen=True, eq=False)
class PagedDecodeKernel:
    """The loaded paged decode attention kernel (``ordinal_paged_decode`` in ``paged_decode.c``).

    One query token per sequence, or a short run of them (a verify's chain, ``runs``); K/V are read in place from
    the pool through the page tables, the GQA group of query heads of one kv head is handled together (with a run's
    queries, as the lanes of one vector), and (sequence, kv head) items run in parallel on
    ``torch.get_num_threads()`` OpenMP threads.
    """

    path: Path
    library: ctypes.CDLL

    @classmethod
    def load(cls, path: Path) -> PagedDecodeKernel:
        """Load a compiled ``paged_decode`` library and declare the entry point's C signature."""
        library = ctypes.CDLL(str(path))
        fn = library.ordinal_paged_decode
        fn.restype = ctypes.c_int
        # Pointers travel as plain addresses (Tensor.data_ptr()); the C side declares their element types.
        fn.argtypes = [
            *[ctypes.c_void_p] * 6,
            *[ctypes.c_int64] * 7,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_void_p,  # runs, or None
            ctypes.c_int64,  # their count
        ]
        return cls(path, library)

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        page_tables: torch.Tensor,
        kv_lens: torch.Tensor,
        page_size: int,
        window: int,
        scale: float,
        runs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [B, H, D]; k_pool, v_pool: [slots, Hkv, D]; page_tables: [B, P] int64; kv_lens: [B] int64; runs:
        [S + 1] int64 or None, sequence s's queries being rows ``runs[s] .. runs[s + 1] - 1`` (None: each row its
        own sequence).

        All CPU float32 (indices int64). ``window`` 0 means full causal attention, otherwise the query at
        position ``kv_lens[b] - 1`` sees the last ``window`` keys. Returns [B, H, D].

        The caller guarantees the values: ``1 <= kv_lens[b] <= P * page_size``, every page id used is inside the
        pool, and ``runs`` rises from 0 to B with the rows of a run sharing its first row's page table (ForwardBatch
        and the model's checks do); shapes, dtypes and layout are checked here.
        """
        batch, heads, head_dim = q.shape
        _check_args(q, k_pool, v_pool, page_tables, kv_lens, page_size, window, runs)
        q = q.contiguous()
        out = torch.empty_like(q)  # [B, H, D]
        status = self.library.ordinal_paged_decode(
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            page_tables.data_ptr(),
            kv_lens.data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            k_pool.shape[1],
            head_dim,
            page_tables.shape[1],
            page_size,
            window,
            scale,
            torch.get_num_threads(),
            None if runs is None else runs.data_ptr(),
            0 if runs is None else runs.shape[0] - 1,
        )
        if status != 0:
            raise MemoryError("paged decode kernel could not allocate its scratch buffers")
        return out


def _check_args(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    window: int,
    runs: torch.Tensor | None = None,
) -> None:
    # Cheap structural checks only: a wrong layout here would be a silent out-of-bounds read in C.
    batch, heads, head_dim = q.shape
    if k_pool.shape != v_pool.shape or k_pool.dim() != 3 or k_pool.shape[2] != head_dim:
        raise ValueError(f"pool shapes {tuple(k_pool.shape)} / {tuple(v_pool.shape)} do not fit q {tuple(q.shape)}")
    if heads % k_pool.shape[1] != 0:
        raise ValueError(f"{heads} query heads are not a multiple of {k_pool.shape[1]} kv heads")
    for name, t, dtype in (
        ("q", q, torch.float32),
        ("k_pool", k_pool, torch.float32),
        ("v_pool", v_pool, torch.float32),
        ("page_tables", page_tables, torch.int64),
        ("kv_lens", kv_lens, torch.int64),
    ):
        if t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
        if name != "q" and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if page_tables.dim() != 2 or page_tables.shape[0] != batch or kv_lens.shape != (batch,):
        raise ValueError(f"page_tables {tuple(page_tables.shape)} / kv_lens {tuple(kv_lens.shape)} vs batch {batch}")
    if page_size <= 0 or window < 0 or k_pool.shape[0] % page_size != 0:
        raise ValueError(f"bad page_size {page_size} or window {window} for a pool of {k_pool.shape[0]} slots")
    if runs is not None and (runs.dtype != torch.int64 or runs.device.type != "cpu" or runs.dim() != 1):
        raise ValueError(f"runs must be a 1-D CPU int64 tensor, got {runs.dtype} {tuple(runs.shape)}")
    if runs is not None and not runs.is_contiguous():
        raise ValueError("runs must be contiguous")


def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The native kernel, or None when ``ORDINAL_NATIVE=0`` or it cannot be built (warned once per process)."""
    return _load_paged_decode() if native_enabled() else None


@functools.cache
def _load_paged_decode() -> PagedDecodeKernel | None:
    return _load_with_found_toolchain(load_paged_decode, "paged decode attention uses the slower torch path")


def _load_with_found_toolchain(load: Callable[[Toolchain, Path], K | None], without: str) -> K | None:
    """``load`` with the C compiler into the kernel cache, or None after warning what happens ``without`` one."""
    toolchain = Toolchain.find()
    if toolchain is None:
        log.warning("no C compiler (cc/gcc) found: %s", without)
        return None
    return load(toolchain, kernel_cache_dir())


def load_paged_decode(toolchain: Toolchain, cache_dir: Path) -> PagedDecodeKernel | None:
    """Build (or find) the paged decode library in ``cache_dir`` and load it; None, with a warning, on failure."""
    return _build_and_load(
        "paged decode", "paged_decode", PAGED_DECODE_SOURCE, PagedDecodeKernel.load, toolchain, cache_dir
    )


@dataclass(frozen=True, eq=False)
class TokenBitmaskKernel:
    """The loaded grammar bitmask kernel (``ordinal_apply_token_bitmask`` in ``token_bitmask.c``).

    One call per step sets every banned token of every row to -inf, in place, without holding the GIL.
    """

    path: Path
    library: ctypes.CDLL

    @classmethod
    def load(cls, path: Path) -> TokenBitmaskKernel:
        """Load a compiled ``token_bitmask`` library and declare the entry point's C signature."""
        library = ctypes.CDLL(str(path))
        fn = library.ordinal_apply_token_bitmask
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 4]
        return cls(path, library)

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
        """logits: [B, >= V] CPU float32; bitmask: [B, >= ceil(V / 32)] CPU int32 in xgrammar's layout (bit j of word
        i set <=> token 32 i + j allowed), both with unit stride along a row. Tokens below ``vocab_size`` whose bit is
        clear become -inf in ``logits``; nothing else changes."""
        _check_bitmask_args(logits, bitmask, vocab_size)
        self.library.ordinal_apply_token_bitmask(
            logits.data_ptr(),
            bitmask.data_ptr(),
            logits.shape[0],
            vocab_size,
            logits.stride(0),
            bitmask.stride(0),
        )


def _check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    # A wrong layout here would be a silent out-of-bounds write in C.
    words = -(-vocab_size // 32)
    for name, t, dtype, width in (
        ("logits", logits, torch.float32, vocab_size),
        ("bitmask", bitmask, torch.int32, words),
    ):
        if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1 or t.shape[1] < width:
            raise ValueError(
                f"{name} must be a CPU {dtype} [B, >= {width}] tensor with unit stride along a row, "
                f"got {t.dtype} on {t.device}, shape {tuple(t.shape)}, strides {t.stride()}"
            )
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} rows of logits")


def token_bitmask_kernel() -> TokenBitmaskKernel | None:
    """The native bitmask kernel, or None when ``ORDINAL_NATIVE=0`` or it cannot be built (warned once per process)."""
    return _load_token_bitmask() if native_enabled() else None


@functools.cache
def _load_token_bitmask() -> TokenBitmaskKernel | None:
    return _load_with_found_toolchain(load_token_bitmask, "grammar bitmasks use the slower torch path")


def load_token_bitmask(toolchain: Toolchain, cache_dir: Path) -> TokenBitmaskKernel | None:
    """Build (or find) the bitmask library in ``cache_dir`` and load it; None, with a warning, on failure."""
    return _build_and_load(
        "token bitmask", "token_bitmask", TOKEN_BITMASK_SOURCE, TokenBitmaskKernel.load, toolchain, cache_dir
    )


def _build_and_load(
    what: str,
    stem: str,
    source: Path,
    load: Callable[[Path], K],
    toolchain: Toolchain,
    cache_dir: Path,
    includes: tuple[Path, ...] = (),
) -> K | None:
    """Build (or find) the library ``stem`` of ``source`` in ``cache_dir`` and ``load`` it; None, warned, on failure."""
    try:
        return load(build_library(stem, source, toolchain, cache_dir, includes))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native %s kernel unavailable, using the torch path: %s", what, exc)
        return None


@dataclass(frozen=True, eq=False)
class DraftChainKernel:
    """The loaded greedy draft chain kernel (``ordinal_draft_chain`` in ``draft_chain.c``): a draft model's whole
    multi-step greedy decode over its paged KV in one call that releases the GIL. Called through
    engine/model/draft_chain.py, which packs the weights and checks every shape first."""

    path: Path
    library: ctypes.CDLL

    @classmethod
    def load(cls, path: Path) -> DraftChainKernel:
        """Load a compiled ``draft_chain`` library and declare the entry point's C signature."""
        library = ctypes.CDLL(str(path))
        fn = library.ordinal_draft_chain
        fn.restype = ctypes.c_int
        # embed, lm_head_t, final_norm, cos, sin, layers, dims | eps | batch | feed tokens and offsets, start_pos,
        # page_tables, depths | max_depth | min_prob | ban offsets, tokens, depths | out_tokens, out_lengths, out_logits
        fn.argtypes = [
            *[ctypes.c_void_p] * 7,
            ctypes.c_float,
            ctypes.c_int64,
            *[ctypes.c_void_p] * 5,
            ctypes.c_int64,
            ctypes.c_float,
            *[ctypes.c_void_p] * 6,
        ]
        return cls(path, library)


def draft_chain_kernel() -> DraftChainKernel | None:
    """The native draft chain kernel, or None when ``ORDINAL_NATIVE=0`` or it cannot be built (warned once)."""
    return _load_draft_chain() if native_enabled() else None


@functools.cache
def _load_draft_chain() -> DraftChainKernel | None:
    return _load_with_found_toolchain(load_draft_chain, "greedy draft chains use the slower torch path")


def load_draft_chain(toolchain: Toolchain, cache_dir: Path) -> DraftChainKernel | None:
    """Build (or find) the draft chain library in ``cache_dir`` and load it; None, with a warning, on failure."""
    return _build_and_load(
        "draft chain",
        "draft_chain",
        DRAFT_CHAIN_SOURCE,
        DraftChainKernel.load,
        toolchain,
        cache_dir,
        DRAFT_CHAIN_INCLUDES,
    )


@dataclass(frozen=True, eq=False)
class PanelLinearKernel:
    """The loaded panel matmul (``ordinal_panel_linear`` in ``panel_matmul.c``): ``y = x @ W.T + bias`` with W packed
    in 32-column panels, batch-invariant (a row's sums do not depend on the other rows or the thread count), in one
    call that releases the GIL. Called through engine/model/panel_linear.py, which packs the weights."""

    path: Path
    library: ctypes.CDLL

    @classmethod
    def load(cls, path: Path) -> PanelLinearKernel:
        """Load a compiled ``panel_matmul`` library and declare the entry point's C signature."""
        library = ctypes.CDLL(str(path))
        fn = library.ordinal_panel_linear
        fn.restype = None
        # x, n, in, panels, out, bias, y, bf16, threads
        fn.argtypes = [
            ctypes.c_void_p,
            *[ctypes.c_int64] * 2,
            ctypes.c_void_p,
            ctypes.c_int64,
            *[ctypes.c_void_p] * 2,
            *[ctypes.c_int] * 2,
        ]
        return cls(path, library)

    def __call__(
        self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [N, in] CPU float32; panels: [ceil(out / 32), in, 32] float32 or bfloat16, contiguous; bias: None or
        [ceil(out / 32) * 32] float32. Returns y [N, out_features] float32."""
        return self.bind(panels, out_features, bias)(x)

    def bind(self, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> BoundPanelLinear:
        """The product with these weights, checked once here; each call then checks only its ``x``."""
        _check_weight_args(panels, out_features, bias)
        bf16 = int(panels.dtype == torch.bfloat16)
        return BoundPanelLinear(self.library.ordinal_panel_linear, panels, out_features, bias, bf16)


@dataclass(frozen=True, eq=False)
class BoundPanelLinear:
    """``x @ W.T + bias`` for one packed weight (:meth:`PanelLinearKernel.bind`): a linear layer's hot path, a few
    microseconds of Python per call."""

    fn: Callable[..., None]
    panels: torch.Tensor  # [ceil(out / 32), in, 32]
    out_features: int
    bias: torch.Tensor | None  # [ceil(out / 32) * 32]
    bf16: int  # the panels hold bf16 values (1) or float32 (0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] CPU float32. Returns y [N, out_features] float32."""
        width = self.panels.shape[1]
        # The checks that keep C inside x (its dtype, layout and width); the weights were checked by bind.
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != width:
            raise ValueError(
                f"x must be a CPU float32 [N, {width}] tensor, got {x.dtype} on {x.device}, {tuple(x.shape)}"
            )
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)  # [N, out]
        bias = self.bias
        self.fn(
            x.data_ptr(),
            x.shape[0],
            width,
            self.panels.data_ptr(),
            self.out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            self.bf16,
            torch.get_num_threads(),
        )
        return y


def _check_weight_args(panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> None:
    # A wrong layout here would be a silent out-of-bounds read in C.
    width = -(-out_features // 32)
    if (
        out_features < 1
        or panels.dtype not in (torch.float32, torch.bfloat16)
        or panels.device.type != "cpu"
        or not panels.is_contiguous()
        or panels.dim() != 3
        or panels.shape[0] != width
        or panels.shape[1] < 1
        or panels.shape[2] != 32
    ):
        raise ValueError(
            f"panels must be a contiguous CPU float32/bfloat16 [{width}, in, 32] tensor for {out_features} outputs, "
            f"got {panels.dtype} on {panels.device}, shape {tuple(panels.shape)}"
        )
    if bias is not None and (
        bias.dtype != torch.float32
        or bias.device.type != "cpu"
        or not bias.is_contiguous()
        or tuple(bias.shape) != (width * 32,)
    ):
        raise ValueError(
            f"bias must be a contiguous CPU float32 [{width * 32}] tensor, got {bias.dtype} {tuple(bias.shape)}"
        )


def panel_linear_kernel() -> PanelLinearKernel | None:
    """The native panel matmul, or None when ``ORDINAL_NATIVE=0`` or it cannot be built (warned once per process)."""
    return _load_panel_linear() if native_enabled() else None


@functools.cache
def _load_panel_linear() -> PanelLinearKernel | None:
    return _load_with_found_toolchain(load_panel_linear, "linear layers use torch's matmul")


def load_panel_linear(toolchain: Toolchain, cache_dir: Path) -> PanelLinearKernel | None:
    """Build (or find) the panel matmul library in ``cache_dir`` and load it; None, with a warning, on failure."""
    return _build_and_load(
        "panel matmul", "panel_matmul", PANEL_MATMUL_SOURCE, PanelLinearKernel.load, toolchain, cache_dir
    )
