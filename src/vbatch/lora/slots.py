"""LoraSlots: one engine core's adapters: registered ones kept on the host, at most `max_loras`
of them resident in the projections' slots (loaded on demand, least recently used out), and
each step's rows grouped by slot."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from vbatch.engine.steps import SchedulerOutput
from vbatch.errors import LoraError
from vbatch.layers.lora import LoraBatch, LoraGroups, LoraLinear
from vbatch.lora.adapter import read_adapter_config
from vbatch.lora.request import LoraRef
from vbatch.lora.weights import LoraPiece, read_adapter_weights
from vbatch.models.config import ModelConfig
from vbatch.models.llama import LlamaForCausalLM, LlamaMLP

# NOTE: how many checkpoint modules one of our projections fuses (q/k/v, gate/up).
_MAX_PIECES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


@dataclass(frozen=True)
class _Adapter:
    ref: LoraRef
    pieces: dict[str, list[LoraPiece]]
    max_rank: int


class LoraSlots:
    """Adapters registered by id (`register`) and the slots of every adapted projection.

    Invariants: `slot_of` maps each resident adapter id to its slot, least recently used
    first, and `slots[s]` is the id in slot s (None when free); every projection's slot s holds
    exactly that adapter's pieces (zeros where it adapts nothing). The scheduler never runs
    more than `max_loras` adapters at once, so a step's adapters always find slots.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
    ) -> None:
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        param = model.embed_tokens.weight
        self.device = param.device
        self.batch = LoraBatch()
        self.linears = _attach(model, model_config, max_loras, self.batch, param.dtype)
        self.shapes = {
            name: (linear.in_features, linear.out_features) for name, linear in self.linears.items()
        }
        self.adapters: dict[int, _Adapter] = {}
        self.slots: list[int | None] = [None] * max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self._last_step_id = -1

    def register(self, ref: LoraRef) -> None:
        """Know adapter `ref.lora_id` (read and checked now); a LoraError names what is wrong,
        or an id already registered for another adapter."""
        known = self.adapters.get(ref.lora_id)
        if known is not None:
            if known.ref != ref:
                raise LoraError(
                    f"LoRA adapter id {ref.lora_id} is {known.ref.name!r} ({known.ref.path}) "
                    f"in this engine, not {ref.name!r} ({ref.path})"
                )
            return
        config = read_adapter_config(ref.name, ref.path, self.max_lora_rank)
        pieces = read_adapter_weights(config, self.model_config, self.shapes, self.max_lora_rank)
        max_rank = max(piece.a.shape[0] for group in pieces.values() for piece in group)
        self.adapters[ref.lora_id] = _Adapter(ref, pieces, max_rank)
        width = next(iter(self.linears.values())).rank_width if self.linears else 0
        if max_rank > width:
            for linear in self.linears.values():
                linear.resize(max_rank)
            self.slots = [None] * self.max_loras
            self.slot_of.clear()
            # NOTE: the next step, even one continuing the last, loads its adapters again.
            self._last_step_id = -1

    def prepare(self, out: SchedulerOutput) -> None:
        """Group `out`'s rows by adapter and make those adapters resident."""
        if out.continues_step != -1 and out.continues_step == self._last_step_id:
            # NOTE: the same seqs, one token each: the same groups.
            self._last_step_id = out.step_id
            return
        self._last_step_id = out.step_id
        rows: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.lora_id:
                rows.setdefault(seq.lora_id, []).append((start, num_new))
            start += num_new
        if not rows:
            self.batch.groups = None
            return
        slots = self._make_resident(list(rows))
        if len(rows) == 1:
            ((lora_id, spans),) = rows.items()
            if sum(n for _, n in spans) == start:
                self.batch.groups = LoraGroups(all_rows_slot=slots[lora_id])
                return
        self.batch.groups = self._groups(rows, slots)

    def _groups(self, rows: dict[int, list[tuple[int, int]]], slots: dict[int, int]) -> LoraGroups:
        order = sorted(rows, key=slots.__getitem__)
        sizes = [sum(n for _, n in rows[lora_id]) for lora_id in order]
        max_rows = max(sizes)
        token_rows = np.zeros((len(order), max_rows), dtype=np.int64)
        is_row = np.zeros((len(order), max_rows, 1), dtype=np.float32)
        for g, lora_id in enumerate(order):
            spans = rows[lora_id]
            token_rows[g, : sizes[g]] = np.concatenate([np.arange(s, s + n) for s, n in spans])
            is_row[g, : sizes[g]] = 1.0
        slot_ids = [slots[lora_id] for lora_id in order]
        is_consecutive = slot_ids == list(range(slot_ids[0], slot_ids[0] + len(slot_ids)))
        dtype = next(iter(self.linears.values())).dtype
        return LoraGroups(
            self._to_device(np.array(slot_ids, dtype=np.int64)),
            self._to_device(token_rows),
            self._to_device(is_row).to(dtype),
            slot_range=(slot_ids[0], slot_ids[-1] + 1) if is_consecutive else None,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        # NOTE: a fresh pinned buffer per copy: the caching host allocator keeps it until the
        # non-blocking copy has run, so the step waits on nothing.
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _make_resident(self, lora_ids: list[int]) -> dict[int, int]:
        """Each of these adapters' slot, loading those not resident into free slots or the
        least recently used slots of adapters not among them."""
        wanted = set(lora_ids)
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id in lora_ids:
            if lora_id not in self.slot_of:
                self._load(lora_id, self._free_slot(wanted))
        return {lora_id: self.slot_of[lora_id] for lora_id in lora_ids}

    def _free_slot(self, wanted: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        for lora_id, slot in self.slot_of.items():
            if lora_id not in wanted:
                del self.slot_of[lora_id]
                self.slots[slot] = None
                return slot
        raise AssertionError("a step runs at most max_loras adapters")

    def _load(self, lora_id: int, slot: int) -> None:
        adapter = self.adapters[lora_id]
        for name, linear in self.linears.items():
            pieces = adapter.pieces.get(name, [])
            linear.set_slot(slot, [(p.row_start, p.a, p.scaled_b) for p in pieces])
        self.slots[slot] = lora_id
        self.slot_of[lora_id] = slot


def _attach(
    model: LlamaForCausalLM,
    config: ModelConfig,
    max_loras: int,
    batch: LoraBatch,
    dtype: torch.dtype,
) -> dict[str, LoraLinear]:
    """A LoraLinear on every attention projection and dense MLP projection of `model`."""
    device = model.embed_tokens.weight.device
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    qkv_size = q_size + 2 * config.num_key_value_heads * head_dim
    shapes = {
        "self_attn.qkv_proj": (hidden, qkv_size),
        "self_attn.o_proj": (q_size, hidden),
        "mlp.gate_up_proj": (hidden, 2 * config.intermediate_size),
        "mlp.down_proj": (config.intermediate_size, hidden),
    }
    linears = {}
    for i, layer in enumerate(model.layers):
        for suffix, (in_features, out_features) in shapes.items():
            block_name, _, proj = suffix.partition(".")
            block = getattr(layer, block_name)
            if block_name == "mlp" and not isinstance(block, LlamaMLP):
                continue
            linear = LoraLinear(
                in_features, out_features, _MAX_PIECES[proj], max_loras, batch, device, dtype
            )
            setattr(block, proj.removesuffix("_proj") + "_lora", linear)
            linears[f"layers.{i}.{suffix}"] = linear
    return linears
