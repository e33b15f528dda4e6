"""The native vbatch:: ops (paged attention, fused RMSNorm, rotary and SwiGLU, the greedy screen,
the decode-batch advance, the packed linear), built from csrc/ on use."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from vbatch.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    BatchPlanner,
    attend_long_chunks,
)

logger = logging.getLogger(__name__)

EXTENSION_NAME = "vbatch_native"
CXX_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
# NOTE: VBATCH_NATIVE_MARCH=haswell builds the kernels as for an AVX2-only CPU (the AVX2
# emulation, benchmarks/emulate.py); the default tunes them to this CPU.
MARCH_ENV = "VBATCH_NATIVE_MARCH"
CUDA_FLAGS = ("-O3",)
BUILD_LOCK_TIMEOUT_S = 600.0
# NOTE: on CUDA the op takes every chunk of at most MAX_NATIVE_QUERY_LEN queries or
# MAX_NATIVE_CHUNK_WORK query-key pairs, and SDPA (one call per chunk) the longer ones. On an H200
# the op ran a step of 8192 prompt tokens (prompts of 39-347 tokens) in 0.16 s, where SDPA's
# per-chunk calls through cuDNN took 2-5 s (see attention._attend). On CPU the op takes every
# row and runs long chunks through its own tiled kernel: 3.3x gather + SDPA at 2 threads
# (`python -m benchmarks.attention_kernels --case prefill`).
MAX_NATIVE_QUERY_LEN = 8
MAX_NATIVE_CHUNK_WORK = 1 << 16


def find_csrc_dir() -> Path | None:
    """Returns the kernel sources: the repo's csrc/ (editable install) or vbatch/_csrc (wheel)."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[3] / "csrc", here.parents[1] / "_csrc"):
        if (candidate / "cpu" / "paged_attention.cpp").is_file():
            return candidate
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("VBATCH_CACHE_DIR") or Path.home() / ".cache" / "vbatch")


def _sources(csrc_dir: Path, with_cuda: bool) -> list[Path]:
    sources = [
        csrc_dir / "torch_bindings.cpp",
        csrc_dir / "cpu" / "paged_attention.cpp",
        csrc_dir / "cpu" / "fused_ops.cpp",
        csrc_dir / "cpu" / "greedy_screen.cpp",
        csrc_dir / "cpu" / "advance_decode.cpp",
        csrc_dir / "cpu" / "logsumexp.cpp",
        csrc_dir / "cpu" / "encoder_attention.cpp",
        csrc_dir / "cpu" / "packed_linear.cpp",
        csrc_dir / "cpu" / "int8_gemm.cpp",
    ]
    if with_cuda:
        sources.append(csrc_dir / "cuda" / "paged_attention.cu")
    return sources


def march_flag() -> str:
    return f"-march={os.environ.get(MARCH_ENV) or 'native'}"


def cpu_flags() -> str:
    # NOTE: -march=native ties a build to this CPU, so the CPU's feature set is part of the key.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def build_key(csrc_dir: Path, with_cuda: bool) -> str:
    """A hash of everything the built library depends on; any change means a fresh build."""
    digest = hashlib.sha256()
    parts = [torch.__version__, sys.version, platform.machine(), cpu_flags(), str(with_cuda)]
    parts += [march_flag(), *CXX_FLAGS, *CUDA_FLAGS, os.environ.get("CXX", "")]
    for part in parts:
        digest.update(part.encode() + b"\0")
    for path in sorted(csrc_dir.rglob("*")):
        if path.suffix in (".cpp", ".cu", ".h"):
            digest.update(str(path.relative_to(csrc_dir)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_and_load(csrc_dir: Path, root: Path, with_cuda: bool) -> Path:
    """Builds the library under root/<key> (once per key, under a file lock) and loads it."""
    from filelock import FileLock

    build_dir = root / "native" / build_key(csrc_dir, with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{EXTENSION_NAME}.so"
    done_marker = build_dir / "built"
    with FileLock(str(build_dir.with_suffix(".lock")), timeout=BUILD_LOCK_TIMEOUT_S):
        if not done_marker.exists():
            # NOTE: we hold the lock, so cpp_extension's own baton file can only be a stale one
            # left by a killed build, and it would make load() wait forever.
            (build_dir / "lock").unlink(missing_ok=True)
            from torch.utils import cpp_extension

            cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(p) for p in _sources(csrc_dir, with_cuda)],
                extra_cflags=[march_flag(), *CXX_FLAGS],
                extra_cuda_cflags=list(CUDA_FLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            done_marker.touch()
            return library
    torch.ops.load_library(str(library))
    return library


def _register_fakes() -> None:
    @torch.library.register_fake("vbatch::paged_attention")
    def _paged_attention_fake(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
        prompt_chunks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("vbatch::reshape_and_cache")
    def _reshape_and_cache_fake(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        return None

    @torch.library.register_fake("vbatch::packed_linear")
    def _packed_linear_fake(
        x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("vbatch::packed_swiglu")
    def _packed_swiglu_fake(
        x: torch.Tensor, packed: torch.Tensor, intermediate: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], intermediate)

    @torch.library.register_fake("vbatch::packed_head_argmax")
    def _packed_head_argmax_fake(
        x: torch.Tensor, chunks: list[torch.Tensor], chunk_cols: int, out_features: int
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], dtype=torch.int64)

    @torch.library.register_fake("vbatch::rms_norm")
    def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("vbatch::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        return None

    @torch.library.register_fake("vbatch::rotary_embedding")
    def _rotary_embedding_fake(
        positions: torch.Tensor, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        return None

    @torch.library.register_fake("vbatch::advance_decode")
    def _advance_decode_fake(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        token_ids: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
    ) -> None:
        return None

    @torch.library.register_fake("vbatch::logsumexp_update")
    def _logsumexp_update_fake(
        tile: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        row_max: torch.Tensor,
        row_sum: torch.Tensor,
        target_logits: torch.Tensor,
    ) -> None:
        return None

    @torch.library.register_fake("vbatch::silu_mul")
    def _silu_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("vbatch::gelu_erf_")
    def _gelu_erf_fake(x: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("vbatch::encoder_attention")
    def _encoder_attention_fake(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("vbatch::int8_greedy_screen")
    def _int8_greedy_screen_fake(
        q_hidden: torch.Tensor,
        q_weight: torch.Tensor,
        row_params: torch.Tensor,
        weight_scales: torch.Tensor,
        residual_norms: torch.Tensor,
        weight_norms: torch.Tensor,
        chunk_size: int,
        max_candidates: int,
        packed_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows = q_hidden.shape[0] // 2
        candidates = q_hidden.new_empty(num_rows, max_candidates, dtype=torch.int64)
        return candidates, q_hidden.new_empty(num_rows, dtype=torch.int64)

    @torch.library.register_fake("vbatch::pack_int8_weight")
    def _pack_int8_weight_fake(weight: torch.Tensor) -> torch.Tensor:
        cols = torch.ops.vbatch.int8_panel_cols()
        panels, groups = -(-weight.shape[0] // cols), -(-weight.shape[1] // 4)
        return weight.new_empty(panels, groups, cols, 4)

    @torch.library.register_fake("vbatch::int8_packed_mm")
    def _int8_packed_mm_fake(
        a: torch.Tensor, packed: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return a.new_empty(a.shape[0], out_features, dtype=torch.int32)

    @torch.library.register_fake("vbatch::pack_int8_linear")
    def _pack_int8_linear_fake(weight: torch.Tensor) -> torch.Tensor:
        cols = torch.ops.vbatch.int8_panel_cols()
        values = torch.ops.vbatch.int8_linear_lane_values()
        panels, groups = -(-weight.shape[0] // cols), -(-weight.shape[1] // values)
        dtype = torch.int16 if values == 2 else torch.int8
        return weight.new_empty(panels, groups, cols, values, dtype=dtype)

    @torch.library.register_fake("vbatch::int8_linear")
    def _int8_linear_fake(
        x: torch.Tensor,
        packed: torch.Tensor,
        col_scale: torch.Tensor,
        col_sums: torch.Tensor,
        col_bias: torch.Tensor,
        out_features: int,
        swiglu: bool,
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("vbatch::int8_quantize_rows")
    def _int8_quantize_rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0])

    @torch.library.register_fake("vbatch::int8_scale_sums")
    def _int8_scale_sums_fake(
        sums: torch.Tensor,
        row_scale: torch.Tensor,
        col_scale: torch.Tensor,
        col_bias: torch.Tensor,
        swiglu: bool,
    ) -> torch.Tensor:
        width = sums.shape[1] // 2 if swiglu else sums.shape[1]
        return sums.new_empty(sums.shape[0], width, dtype=torch.float32)

    @torch.library.register_fake("vbatch::int8_quantize_head")
    def _int8_quantize_head_fake(
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        vocab = weight.shape[0]
        q_weight = weight.new_empty(weight.shape, dtype=torch.int8)
        return q_weight, weight.new_empty(vocab), weight.new_empty(vocab), weight.new_empty(vocab)


def try_build_and_load(csrc_dir: Path, root: Path, with_cuda: bool) -> bool:
    """build_and_load that logs a one-line notice and returns False instead of raising."""
    try:
        build_and_load(csrc_dir, root, with_cuda)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # NOTE: a failed build's message starts with the compiler command; the cause is below it.
        reason = next((line for line in lines if "error:" in line), lines[0] if lines else "")
        logger.warning("vbatch native kernels unavailable (%s): %s", type(exc).__name__, reason)
        return False
    return True


@functools.cache
def is_available() -> bool:
    """Whether the vbatch:: ops are loaded; builds them on the first call, never raises."""
    csrc_dir = find_csrc_dir()
    if csrc_dir is None:
        logger.warning("vbatch native kernels unavailable: csrc sources not found")
        return False
    if not try_build_and_load(csrc_dir, cache_dir(), _with_cuda()):
        return False
    _register_fakes()
    return True


@functools.cache
def library_key() -> str | None:
    """The build key of the loaded library (what its packed weight layout depends on), None
    where none is loaded."""
    csrc_dir = find_csrc_dir()
    if csrc_dir is None or not is_available():
        return None
    return build_key(csrc_dir, _with_cuda())


def _with_cuda() -> bool:
    """Whether the library is built with its CUDA kernels (a CUDA build of torch, a GPU)."""
    return torch.cuda.is_available() and torch.version.cuda is not None


def has_fused_ops(device: torch.device) -> bool:
    """Whether the fused norm and rotary ops serve `device` (CPU kernels only, so far)."""
    return device.type == "cpu" and is_available()


class NativeAttentionBackend(AttentionBackend):
    """Paged attention through the vbatch:: custom ops (C++/OpenMP on CPU, CUDA on GPU).

    Invariant: constructed only when is_available(); the ops read K/V straight from the cache
    through the block tables, with no gathered copy of the context. On CPU one op call serves
    the whole batch; on CUDA, prefill chunks past MAX_NATIVE_QUERY_LEN and MAX_NATIVE_CHUNK_WORK
    run through SDPA over their gathered context instead.
    """

    name = "native"

    def __init__(self) -> None:
        assert is_available(), "NativeAttentionBackend needs the native kernels built"
        self._planner = BatchPlanner(MAX_NATIVE_QUERY_LEN, MAX_NATIVE_CHUNK_WORK)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        torch.ops.vbatch.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        # NOTE: the ops take 0 for "no window" and "no soft cap".
        window, cap = sliding_window or 0, softcap or 0.0
        plan = None
        if meta.max_query_len > MAX_NATIVE_QUERY_LEN and q.device.type != "cpu":
            plan = self._planner.plan(meta)
        if plan is None or not plan.long_chunks:
            # [num_tokens, num_heads, head_dim]
            return torch.ops.vbatch.paged_attention(
                q,
                k_cache,
                v_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                window,
                cap,
                meta.prompt_chunks if q.device.type == "cpu" else None,
            )
        out = torch.empty_like(q)
        if plan.short_rows is not None:
            out[plan.short_rows] = torch.ops.vbatch.paged_attention(
                q.index_select(0, plan.short_rows),
                k_cache,
                v_cache,
                plan.short_query_start_loc,
                plan.short_seq_lens,
                plan.short_block_tables,
                scale,
                window,
                cap,
            )
        attend_long_chunks(q, k_cache, v_cache, plan, out, scale, sliding_window, softcap)
        return out
