"""Which GEMM library runs each float32 linear on CPU, chosen by measurement per row count.

torch's CPU GEMM (MKL in the x86-64 builds) and oneDNN's inner product rank differently on
different CPUs: on an AVX2-only AMD EPYC oneDNN ran SmolLM2's MLP and LM-head GEMMs 1.5-2.4x
faster than MKL at 2 threads, while on an AVX-512 Xeon MKL was up to 2x faster at some decode
shapes, and MKL's W @ x^T form (LlamaMLP's transposed path) won there at 16-128 rows but lost
5-9x at one row on the EPYC, where vbatch's own packed kernel (csrc/cpu/packed_linear.cpp) beat
both at decode row counts. So the engine times the candidates on the model's own shapes at a
few row counts and keeps, per projection and row class, the fastest; the decision is cached per
machine (layers/kernel_choice.py). Every candidate computes the same float32 products; the
libraries sum them in another order, so logits can differ in the last bits between choices, as
they already do between batch sizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from vbatch.errors import ConfigError
from vbatch.layers import native
from vbatch.layers.kernel_choice import cached_choice, fastest_ms
from vbatch.layers.packed_store import PackedStore

# NOTE: a step's row count is timed as the nearest of these: one decode row, a few, a decode
# batch, a prefill chunk, a full prefill step (the default max_num_batched_tokens; an
# encoder's usual step). Bounds are the geometric middles.
TIMED_ROWS = (1, 8, 64, 512, 2048)
# NOTE: output columns at which a mapped native copy is checked against its weight.
PROBED_COLUMNS = 16
CLASS_BOUNDS = (2, 24, 192, 1024)
BACKENDS = ("torch", "onednn")
# NOTE: vbatch::packed_linear (csrc/cpu/packed_linear.cpp), a candidate in every row class
# where the native kernels are loaded; it runs only from its packed copy of the weight. Over the
# 30 layers' own weights on the quiet AVX2 EPYC it beat oneDNN 1.3x at 64 rows and 1.13-1.15x
# at 512 and 2048 (at load 1-2 an earlier run had it losing 0.8x at 512).
NATIVE = "native"
# NOTE: LlamaMLP's W @ x^T form, only for row counts it was written for (models/llama.py).
TRANSPOSED = "torch-transposed"
SEPARATE = "separate"
MAX_TRANSPOSED_CLASS = 2
PADDED_ROW_MULTIPLE = 8
# NOTE: in a decode step each layer's MLP weights come from memory, the other layers' having
# streamed past the caches since. Timed from one copy they stay cached, and there MKL's W @ x^T
# tied the packed kernel at 64 rows on the Intel Xeon held to AVX2 (72.1 against 70.7 ms over
# 30 layers), while over the 30 layers' own weights it ran 1.23x slower at 64 rows and 1.6x at
# 32 (91.2 against 74.3 ms, 65.2 against 40.9). So the pair is timed over a ring of copies that
# spans this many bytes: a ring of 8 layers' weights already ran within 2-6% of the 30 layers'.
# A model whose MLP is smaller than COLD_SPAN / MAX_RING_COPIES stays in the caches anyway.
COLD_SPAN = 64 << 20
MAX_RING_COPIES = 16
HEAD_CHUNK = 3072
ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# NOTE: the prepared copies (about the model's size again per backend that needs one) are made
# only if they fit this share of the free RAM, which leaves the rest to the KV cache.
MAX_COPIED_SHARE = 0.5
# NOTE: a projection runs from one prepared copy; a second backend's copy is made only for the
# classes where it beats the first by this factor. Each copy is the projection's weights again
# in fresh memory, and on a VM fresh pages can cost ~30 us each to fault in: on the AVX-512 EPYC
# (Zen 4) oneDNN led the packed kernel by 2-10% at 512 and 2048 rows, and taking it there (a
# second copy, made at the first prefill) made the 64-prompt e2e job 41.5-42.3 s against
# 35.0-35.4 s with the packed kernel alone (6.8 against 2 s of system CPU).
SECOND_COPY_GAIN = 1.15
# NOTE: the row count oneDNN lays a reordered weight out for; it serves every row count, and a
# layout for 64 rows ran 1-2048 rows as fast as each count's own on the AVX2 EPYC.
PACKED_FOR_ROWS = 64


def row_class(num_rows: int) -> int:
    """The index in TIMED_ROWS whose timing stands for a call of num_rows rows."""
    for index, bound in enumerate(CLASS_BOUNDS):
        if num_rows <= bound:
            return index
    return len(CLASS_BOUNDS)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [n, in_features] @ weight^T (+ bias) through oneDNN's float32 inner product; `weight`
    plain [out, in] or from onednn_weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered once into oneDNN's own blocked layout (a copy), or `weight` itself
    where this torch cannot reorder. A plain weight is reordered inside every call: at 8-64
    rows, SmolLM2's GEMMs ran 1.2-2x faster from the reordered copy on the AVX2 EPYC."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
    except (AttributeError, RuntimeError):
        return weight


def native_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [n, in_features] @ weight^T (+ bias) through vbatch::packed_linear, from
    prepared_weight(weight, "native")."""
    return torch.ops.vbatch.packed_linear(x, packed, out_features, bias)


def native_swiglu(
    x: torch.Tensor, packed: torch.Tensor, intermediate: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of x [n, in_features] through a gate/up projection (gate rows, then as
    many up rows) packed by vbatch::pack_swiglu_weight: the bits of native_linear then
    vbatch::silu_mul, without the [n, 2 * intermediate] gate/up output."""
    return torch.ops.vbatch.packed_swiglu(x, packed, intermediate, bias)


def native_head_argmax(
    hidden: torch.Tensor, chunks: list[torch.Tensor], out_features: int
) -> torch.Tensor:
    """[n] int64: each row's argmax over hidden @ weight^T (the first maximum, as torch.argmax),
    from head_chunks(weight, "native"), through vbatch::packed_head_argmax: the logits are never
    written out."""
    return torch.ops.vbatch.packed_head_argmax(hidden, chunks, HEAD_CHUNK, out_features)


def available_backends() -> tuple[str, ...]:
    """BACKENDS, and "native" where the vbatch:: kernels are loaded."""
    return (*BACKENDS, NATIVE) if native.is_available() else BACKENDS


def prepared_weight(weight: torch.Tensor, backend: str) -> torch.Tensor:
    """`weight` as `backend` runs it: oneDNN's reordered copy, or the native kernel's panels."""
    if backend == NATIVE:
        if not native.is_available():
            raise ConfigError("the native linear needs the vbatch native kernels, not loaded here")
        return torch.ops.vbatch.pack_linear_weight(weight.detach())
    return onednn_weight(weight)


class ChosenLinear(nn.Linear):
    """An nn.Linear (sharing the original's parameters) run by the backend chosen for its row
    class: `backends[row_class(rows)]`, "torch", "onednn" or "native". Each backend in `copies`
    runs from its own prepared copy of the weight (`prepared`), made at its first call, so a job
    whose steps never reach a class pays neither the time nor the RAM of that class's copy;
    oneDNN outside `copies` runs from the plain weight, and "native" runs only from its copy.

    With `swiglu_size` (a gated MLP's gate/up projection: gate rows, then as many up rows), the
    native copy is packed for vbatch::packed_swiglu, and `swiglu` returns silu(gate) * up in one
    pass where the row class runs natively; `forward` still returns the plain gate/up output.

    With a `store`, the native copy comes from it under `name` (mapped from disk where the
    store's file has it and it computes this layer, layers/packed_store.py)."""

    def __init__(
        self,
        linear: nn.Linear,
        backends: tuple[str, ...],
        copies: Collection[str] = (NATIVE, "onednn"),
        swiglu_size: int | None = None,
        store: PackedStore | None = None,
        name: str = "",
    ) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.backends = backends
        if NATIVE in backends and NATIVE not in copies:
            raise ValueError("the native linear runs only from its packed copy of the weight")
        self.copied = frozenset(backend for backend in backends if backend in copies)
        self.prepared: dict[str, torch.Tensor] = {}
        self.swiglu_size = swiglu_size
        self.store = store
        self.name = name

    def pending_copy_bytes(self) -> int:
        """The bytes of the prepared copies not made yet (each about the weight's size)."""
        weight_bytes = self.weight.numel() * self.weight.element_size()
        return weight_bytes * len(self.copied - self.prepared.keys())

    def backend_weight(self, backend: str) -> torch.Tensor:
        """The weight `backend` runs from: its prepared copy (made now if this is its first
        call) or the plain weight."""
        if backend not in self.copied:
            return self.weight
        prepared = self.prepared.get(backend)
        if prepared is None:
            if backend != NATIVE:
                prepared = prepared_weight(self.weight, backend)
            elif self.store is None:
                prepared = self._pack(self.weight)
            else:
                (prepared,) = self.store.tensors(
                    (self.name,),
                    lambda: (self._pack(self.weight),),
                    lambda mapped: self._computes_this_layer(mapped[0]),
                )
            self.prepared[backend] = prepared
        return prepared

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self.swiglu_size is not None:
            return torch.ops.vbatch.pack_swiglu_weight(weight.detach())
        return prepared_weight(weight, NATIVE)

    def _computes_this_layer(self, packed: torch.Tensor) -> bool:
        """Whether the native copy `packed` gives this layer's output (bias aside) for one
        random row, checked at PROBED_COLUMNS of its columns: a copy of other weights, or in
        another layout, does not."""
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.in_features, generator=generator)
        num_columns = self.swiglu_size or self.out_features
        columns = torch.randint(num_columns, (PROBED_COLUMNS,), generator=generator)
        with torch.no_grad():
            try:
                if self.swiglu_size is not None:
                    got = native_swiglu(x, packed, self.swiglu_size)[0, columns]
                    gate = x @ self.weight[columns].t()
                    up = x @ self.weight[columns + self.swiglu_size].t()
                    expected = (F.silu(gate) * up)[0]
                else:
                    got = native_linear(x, packed, self.out_features)[0, columns]
                    expected = (x @ self.weight[columns].t())[0]
            except RuntimeError:
                return False
        tolerance = 1e-4 * float(expected.abs().max()) + 1e-6
        return bool((got - expected).abs().max() <= tolerance)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        backend = self.backends[row_class(flat.shape[0])]
        if backend == "torch":
            return F.linear(x, self.weight, self.bias)
        weight = self.backend_weight(backend)
        if backend == NATIVE and self.swiglu_size is not None:
            out = self._unpacked_swiglu_linear(flat, weight)
        elif backend == NATIVE:
            out = native_linear(flat, weight, self.out_features, self.bias)
        else:
            out = onednn_linear(flat, weight, self.bias)
        return out.view(*x.shape[:-1], -1)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up in one pass where x's row class runs the native kernel from a SwiGLU
        packing; None elsewhere."""
        flat = x.reshape(-1, self.in_features)
        if self.swiglu_size is None or self.backends[row_class(flat.shape[0])] != NATIVE:
            return None
        act = native_swiglu(flat, self.backend_weight(NATIVE), self.swiglu_size, self.bias)
        return act.view(*x.shape[:-1], -1)

    def _unpacked_swiglu_linear(self, flat: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The plain gate/up output from the SwiGLU packing: each panel's gate and up columns
        put back in place (the bias added after, as the kernel adds it: one add per output)."""
        assert self.swiglu_size is not None
        num_panels, _, panel = packed.shape
        lanes = panel // 2
        out = native_linear(flat, packed, num_panels * panel)
        halves = (
            out.view(-1, num_panels, 2, lanes).transpose(1, 2).reshape(-1, 2, num_panels * lanes)
        )
        plain = halves[:, :, : self.swiglu_size].reshape(-1, self.out_features)
        return plain if self.bias is None else plain.add_(self.bias)


def head_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    buffer: torch.Tensor,
    backend: str,
    in_place: bool = False,
    chunks: list[torch.Tensor] | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """hidden @ weight^T, HEAD_CHUNK vocab rows at a time: (first vocab id, [n, chunk] tile).
    torch's tiles are written into `buffer`: its first columns, which the next tile overwrites,
    or with `in_place` (buffer [n, vocab]) the tile's own columns; oneDNN's and the native
    kernel's are fresh tensors, from `chunks` (head_chunks(weight, backend); required for
    "native", optional for oneDNN). A GEMM over one chunk keeps its output tile in cache."""
    vocab_size = weight.shape[0]
    for start in range(0, vocab_size, HEAD_CHUNK):
        end = min(start + HEAD_CHUNK, vocab_size)
        if backend == NATIVE:
            assert chunks is not None
            yield start, native_linear(hidden, chunks[start // HEAD_CHUNK], end - start)
        elif backend == "onednn":
            chunk = weight[start:end] if chunks is None else chunks[start // HEAD_CHUNK]
            yield start, onednn_linear(hidden, chunk)
        else:
            tile = buffer[:, start:end] if in_place else buffer[:, : end - start]
            torch.mm(hidden, weight[start:end].t(), out=tile)
            yield start, tile


def head_chunks(weight: torch.Tensor, backend: str) -> list[torch.Tensor]:
    """The LM head's [vocab, hidden] weight as head_tiles' chunks, each through prepared_weight."""
    return [
        prepared_weight(weight[start : start + HEAD_CHUNK], backend)
        for start in range(0, weight.shape[0], HEAD_CHUNK)
    ]


def _transposed_mlp(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rows: int,
    generator: torch.Generator,
    swiglu: bool,
) -> Callable[[], object]:
    """LlamaMLP's transposed form at `rows` rows, with its vbatch::silu_mul where `swiglu`."""
    padded = rows + (-rows % PADDED_ROW_MULTIPLE)
    x_t = torch.randn(gate_up.shape[1], padded, generator=generator)
    act_t = torch.randn(down.shape[1], padded, generator=generator)
    intermediate = gate_up.shape[0] // 2

    def run() -> object:
        gate_up_t = torch.mm(gate_up, x_t)
        if swiglu:
            torch.ops.vbatch.silu_mul(gate_up_t[:intermediate], gate_up_t[intermediate:])
        return torch.mm(down, act_t)[:, :rows].t().contiguous()

    return run


def linear_candidates(
    weight: torch.Tensor,
    prepared: dict[str, torch.Tensor],
    rows: int,
    generator: torch.Generator,
) -> dict[str, Callable[[], object]]:
    """A float32 linear of `weight` [out, in] at `rows` random rows through each backend, from
    `prepared` (prepared_weight's copies; "native" only where given)."""
    x = torch.randn(rows, weight.shape[1], generator=generator)
    out_features = weight.shape[0]
    candidates: dict[str, Callable[[], object]] = {
        "torch": lambda: F.linear(x, weight),
        "onednn": lambda: onednn_linear(x, prepared["onednn"]),
    }
    if NATIVE in prepared:
        candidates[NATIVE] = lambda: native_linear(x, prepared[NATIVE], out_features)
    return candidates


def swiglu_candidates(
    weight: torch.Tensor,
    prepared: dict[str, torch.Tensor],
    rows: int,
    generator: torch.Generator,
) -> dict[str, Callable[[], object]]:
    """silu(gate) * up at `rows` random rows from a gate/up projection `weight` [2I, in] (gate
    rows, then up rows) as the MLP runs it on each backend: torch's and oneDNN's GEMM, then
    vbatch::silu_mul over the [rows, 2I] output; the native kernel in one pass from its SwiGLU
    packing (`prepared[NATIVE]`, pack_swiglu_weight's). At a prefill's row count the separate
    pass rereads an output larger than the caches (25 MB at 2048 rows of SmolLM2), which a
    timing of the GEMM alone leaves out."""
    x = torch.randn(rows, weight.shape[1], generator=generator)
    intermediate = weight.shape[0] // 2

    def then_silu_mul(gemm: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            gate, up = gemm().split(intermediate, dim=-1)
            return torch.ops.vbatch.silu_mul(gate, up)

        return run

    candidates: dict[str, Callable[[], object]] = {
        "torch": then_silu_mul(lambda: F.linear(x, weight)),
        "onednn": then_silu_mul(lambda: onednn_linear(x, prepared["onednn"])),
    }
    if NATIVE in prepared:
        candidates[NATIVE] = lambda: native_swiglu(x, prepared[NATIVE], intermediate)
    return candidates


def _head_candidates(
    weight: torch.Tensor,
    chunks: dict[str, list[torch.Tensor]],
    rows: int,
    generator: torch.Generator,
) -> dict[str, Callable[[], object]]:
    """The LM head at `rows` rows as greedy decoding runs it through each backend: every vocab
    tile's row maxima, or the native kernel's argmax fused into its GEMM."""
    hidden = torch.randn(rows, weight.shape[1], generator=generator)
    buffer = hidden.new_empty(rows, HEAD_CHUNK)

    def run(backend: str) -> Callable[[], object]:
        if backend == NATIVE:
            return lambda: native_head_argmax(hidden, chunks[NATIVE], weight.shape[0])

        def maxima() -> object:
            tiles = head_tiles(hidden, weight, buffer, backend, chunks=chunks.get(backend))
            return [tile.max(dim=1) for _, tile in tiles]

        return maxima

    return {backend: run(backend) for backend in ("torch", *chunks)}


def _prepared(
    role: str, weight: torch.Tensor, backends: Collection[str], swiglu: bool
) -> dict[str, torch.Tensor]:
    """`weight`'s prepared copy for each of `backends` but torch (gate_up's native copy in the
    SwiGLU packing where `swiglu`)."""
    prepared = {b: prepared_weight(weight, b) for b in backends if b not in ("torch", NATIVE)}
    if NATIVE in backends:
        if role == "gate_up" and swiglu:
            prepared[NATIVE] = torch.ops.vbatch.pack_swiglu_weight(weight.detach())
        else:
            prepared[NATIVE] = prepared_weight(weight, NATIVE)
    return prepared


def _layer_candidates(
    role: str,
    weight: torch.Tensor,
    prepared: dict[str, torch.Tensor],
    rows: int,
    generator: torch.Generator,
    swiglu: bool,
) -> dict[str, Callable[[], object]]:
    """A layer projection's candidates at `rows` rows (gate_up with its activation where
    `swiglu`)."""
    if role == "gate_up" and swiglu:
        return swiglu_candidates(weight, prepared, rows, generator)
    return linear_candidates(weight, prepared, rows, generator)


def _role_sets(
    role: str,
    weight: torch.Tensor,
    backends: tuple[str, ...],
    timed_head_rows: int,
    generator: torch.Generator,
    swiglu: bool,
) -> dict[str, dict[str, Callable[[], object]]]:
    """The candidates of one projection ("lm_head": the LM head, up to `timed_head_rows` rows;
    "gate_up" with its activation where `swiglu`) per row class, keyed "role@rows"."""
    if role == "lm_head":
        chunks = {b: head_chunks(weight, b) for b in backends if b != "torch"}
        return {
            f"{role}@{rows}": _head_candidates(weight, chunks, rows, generator)
            for rows in TIMED_ROWS
            if rows <= timed_head_rows
        }
    prepared = _prepared(role, weight, backends, swiglu)
    return {
        f"{role}@{rows}": _layer_candidates(role, weight, prepared, rows, generator, swiglu)
        for rows in TIMED_ROWS
    }


def weight_ring(weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """`weights` itself, then fresh copies of it, enough to span COLD_SPAN bytes (at most
    MAX_RING_COPIES in all)."""
    size = sum(weight.numel() * weight.element_size() for weight in weights.values())
    copies = min(MAX_RING_COPIES, -(-COLD_SPAN // max(size, 1)))
    return [weights] + [
        {name: weight.detach().clone() for name, weight in weights.items()}
        for _ in range(copies - 1)
    ]


def _cold_mlp_pairs(
    weights: dict[str, torch.Tensor],
    picks: dict[str, list[str]],
    generator: torch.Generator,
    swiglu: bool,
) -> dict[str, dict[str, Callable[[], object]]]:
    """Per row class the transposed form may run (timed as "mlp@rows"), it and the separate
    GEMMs' picks run back to back, each call from the next copy of a ring spanning COLD_SPAN
    bytes."""
    mlp_roles = ("gate_up", "down")
    classes = [i for i, rows in enumerate(TIMED_ROWS) if row_class(rows) <= MAX_TRANSPOSED_CLASS]
    ring = weight_ring({role: weights[role] for role in mlp_roles})
    prepared = [
        {
            role: _prepared(role, member[role], {picks[role][i] for i in classes}, swiglu)
            for role in mlp_roles
        }
        for member in ring
    ]
    pairs = {}
    for index in classes:
        rows = TIMED_ROWS[index]
        transposed, separate = [], []
        for member, copies in zip(ring, prepared, strict=True):
            transposed.append(
                _transposed_mlp(member["gate_up"], member["down"], rows, generator, swiglu)
            )
            gemms = [
                _layer_candidates(role, member[role], copies[role], rows, generator, swiglu)[
                    picks[role][index]
                ]
                for role in mlp_roles
            ]
            separate.append(_in_turn(*gemms))
        pairs[f"mlp@{rows}"] = {TRANSPOSED: _cycling(transposed), SEPARATE: _cycling(separate)}
    return pairs


def _in_turn(*fns: Callable[[], object]) -> Callable[[], object]:
    """One call that runs `fns` back to back."""
    return lambda: [fn() for fn in fns]


def _cycling(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of the next of `fns`, in turn."""
    turns = itertools.cycle(fns)
    return lambda: next(turns)()


def choose_linear_backends(
    weights: dict[str, torch.Tensor],
    transposed_mlp: bool = True,
    timed_head_rows: int = 64,
    swiglu: bool = False,
) -> dict[str, Any]:
    """The fastest backend per projection and row class on this machine, from `weights`:
    "qkv", "o", "gate_up" and "down" ([out, in]) of one layer and, if given, "lm_head"
    ([vocab, hidden]). The candidates are torch's GEMM, oneDNN and, where loaded, the native
    kernel, each from its prepared copy. The layer's projections at every class are timed in the
    same rounds (kernel_choice.fastest_ms), then the LM head's classes; if the model has the
    MLP's transposed form (`transposed_mlp`), it is timed next as a pair, interleaved with the
    two GEMMs' own picks run back to back, and taken where it beats them. The LM head is timed
    up to `timed_head_rows` rows (a step samples few rows), its last class reusing that. With
    `swiglu` (the MLP fuses SiLU and the gate product into the native GEMM: LlamaMLP.fused_silu)
    gate_up is timed with its activation on every side (swiglu_candidates). Cached per machine
    and shape set.

    Returns {"rows": TIMED_ROWS, "qkv"|"o"|"gate_up"|"down"|"lm_head": [backend per class],
    "mlp": [TRANSPOSED or SEPARATE per class], "ms": ...}."""
    backends = available_backends()

    def measure() -> dict[str, Any]:
        generator = torch.Generator().manual_seed(0)
        choice: dict[str, Any] = {"rows": list(TIMED_ROWS), "ms": {}}
        roles = [role for role in ("qkv", "o", "gate_up", "down") if role in weights]
        # NOTE: the LM head's copies, the largest, are timed apart from the layers' and after.
        for group in (roles, ["lm_head"] if "lm_head" in weights else []):
            sets: dict[str, dict[str, Callable[[], object]]] = {}
            for role in group:
                sets |= _role_sets(
                    role, weights[role], backends, timed_head_rows, generator, swiglu
                )
            choice["ms"] |= fastest_ms(sets)
            for role in group:
                picks: list[str] = []
                for rows in TIMED_ROWS:
                    timed = choice["ms"].get(f"{role}@{rows}")
                    if timed is None:
                        picks.append(picks[-1])
                        continue
                    picks.append(min(timed, key=timed.__getitem__))
                choice[role] = picks
        # NOTE: the transposed MLP is timed against the two picks run back to back in the same
        # rounds, so that load from another process weighs on both sides alike.
        pairs = _cold_mlp_pairs(weights, choice, generator, swiglu) if transposed_mlp else {}
        choice["ms"] |= fastest_ms(pairs)
        choice["mlp"] = [SEPARATE] * len(TIMED_ROWS)
        for index, rows in enumerate(TIMED_ROWS):
            timed = choice["ms"].get(f"mlp@{rows}")
            if timed is not None and timed[TRANSPOSED] < timed[SEPARATE]:
                choice["mlp"][index] = TRANSPOSED
        return choice

    shapes = {name: list(weight.shape) for name, weight in sorted(weights.items())}
    key = {
        "shapes": shapes,
        "transposed_mlp": transposed_mlp,
        "rows": list(TIMED_ROWS),
        "backends": list(backends),
        "native_in_every_class": True,
        "native_head": "argmax",
        "swiglu": swiglu,
        "mlp_from_memory": COLD_SPAN,
    }

    def is_valid(choice: Any) -> bool:
        if not isinstance(choice, dict) or choice.get("rows") != list(TIMED_ROWS):
            return False
        picks = [choice.get(role) for role in weights]
        return (
            all(
                isinstance(p, list) and len(p) == len(TIMED_ROWS) and set(p) <= set(backends)
                for p in picks
            )
            and isinstance(choice.get("mlp"), list)
            and len(choice["mlp"]) == len(TIMED_ROWS)
            and set(choice["mlp"]) <= {TRANSPOSED, SEPARATE}
            and isinstance(choice.get("ms"), dict)
        )

    return cached_choice("linears", key, measure, is_valid)  # type: ignore[dict-item]


def settle_linears(
    backend: str,
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    transposed_mlp: bool = True,
    one_copy: bool = True,
    swiglu: bool = False,
) -> tuple[dict[str, Any], str] | None:
    """The choice for `backend` ("auto" measures, then with `one_copy` keeps each projection to
    one prepared copy where a second gains little: one_copy_picks, for an engine whose steps
    range from one row to full prefills; "onednn" or "native" forces it; "torch" keeps the model
    as built: None) over `weights` of `model` (none: None), and its line for the manifest.

    The choice's "copies" lists the backends that run from prepared copies: every chosen one if
    a copy of `model` per backend fits MAX_COPIED_SHARE of the free RAM, else the native
    kernel's alone if one copy fits (oneDNN then runs from the plain weights), else none (and
    the native picks fall back to the next fastest candidate timed for their class)."""
    if backend == "torch" or not weights:
        return None
    if backend == NATIVE and not native.is_available():
        raise ConfigError("linear_backend native needs the vbatch native kernels, not loaded here")
    if backend in (NATIVE, "onednn"):
        choice = forced_everywhere(backend, "lm_head" in weights)
    else:
        choice = choose_linear_backends(weights, transposed_mlp, swiglu=swiglu)
    roles = [role for role in ROLES if role in choice]
    if backend == "auto" and one_copy:
        choice = {**choice, **{role: one_copy_picks(choice, role) for role in roles}}
    chosen = [b for b in (NATIVE, "onednn") if any(b in choice[role] for role in roles)]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = psutil.virtual_memory().available * MAX_COPIED_SHARE
    copies = next((kept for kept in (chosen, chosen[:1]) if model_bytes * len(kept) <= budget), [])
    choice = {**choice, "copies": copies}
    if NATIVE not in copies:
        choice.update({role: without_native(choice, role) for role in roles})
    return choice, describe_linear_choice(choice, None if backend == "auto" else backend)


def runs_at_any_thread_count(choice: dict[str, Any]) -> bool:
    """Whether every linear of a settled `choice` gives the same bits at any thread count: the
    native kernel (each output one k-ordered FMA chain on one thread) for every projection and
    row class, and no transposed MLP (MKL's GEMMs, like oneDNN's, may split a sum across
    threads: measured at 6 rows of a 64-wide model for MKL, one row of K = 2048 for oneDNN)."""
    roles = [role for role in ROLES if role in choice]
    native_everywhere = all(pick == NATIVE for role in roles for pick in choice[role])
    return bool(roles) and native_everywhere and TRANSPOSED not in choice.get("mlp", [])


def one_copy_picks(choice: dict[str, Any], role: str) -> list[str]:
    """`choice[role]` with its classes that run from a prepared copy run by one backend: the
    one that loses least, summed over those classes relative to each class's fastest; another
    keeps a class only where it is SECOND_COPY_GAIN faster. Classes past the last timed one
    (the LM head's) follow it."""
    picks = list(choice[role])
    timed = [choice.get("ms", {}).get(f"{role}@{rows}") for rows in choice["rows"]]
    copied = [i for i, pick in enumerate(picks) if pick != "torch" and timed[i] is not None]
    backends = {picks[i] for i in copied}
    if len(backends) < 2:
        return picks

    def loss(backend: str) -> float:
        return sum(timed[i][backend] / timed[i][picks[i]] for i in copied)  # type: ignore[index]

    main = min(sorted(backends), key=loss)
    for i, pick in enumerate(picks):
        ms = timed[i]
        if ms is None:
            picks[i] = picks[i - 1] if i > 0 and pick != "torch" else pick
        elif pick not in ("torch", main) and ms[main] <= ms[pick] * SECOND_COPY_GAIN:
            picks[i] = main
    return picks


def without_native(choice: dict[str, Any], role: str) -> list[str]:
    """`choice[role]` with each native pick replaced by the fastest other candidate timed for
    that class (oneDNN where none was timed)."""
    picks: list[str] = []
    for rows, pick in zip(choice["rows"], choice[role], strict=True):
        if pick == NATIVE:
            timed = {b: ms for b, ms in choice.get("ms", {}).get(f"{role}@{rows}", {}).items()}
            timed.pop(NATIVE, None)
            pick = min(timed, key=timed.__getitem__) if timed else "onednn"
        picks.append(pick)
    return picks


def forced_everywhere(backend: str, has_head: bool) -> dict[str, Any]:
    """The choice that runs every linear, and the LM head if `has_head`, through `backend`."""
    choice: dict[str, Any] = {"rows": list(TIMED_ROWS), "mlp": [SEPARATE] * len(TIMED_ROWS)}
    for role in ROLES[:4] + (("lm_head",) if has_head else ()):
        choice[role] = [backend] * len(TIMED_ROWS)
    return choice


def describe_linear_choice(choice: dict[str, Any], forced: str | None) -> str:
    """One line for the manifest and the dashboard, e.g. "linears (measured): qkv torch/onednn
    ..." with one entry per row class of TIMED_ROWS."""
    rows = "/".join(str(r) for r in choice["rows"])
    parts = [
        f"{role} {'/'.join(choice[role])}"
        for role in ("qkv", "o", "gate_up", "down", "mlp", "lm_head")
        if role in choice and (role != "mlp" or TRANSPOSED in choice[role])
    ]
    how = f"forced {forced}" if forced else "measured"
    uses_onednn = any("onednn" in choice[role] for role in ROLES if role in choice)
    is_plain = uses_onednn and "onednn" not in choice.get("copies", ["onednn"])
    plain = "; oneDNN from plain weights: no RAM for copies" if is_plain else ""
    return f"linears ({how}; at {rows} rows): " + ", ".join(parts) + plain
