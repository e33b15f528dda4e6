"""ModelRunner: the model, the paged KV cache, batch tensors, one forward pass and sampling."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from vbatch.config import EngineConfig
from vbatch.engine.sampler import Sampler, SamplingMetadata, free_generators
from vbatch.engine.scheduler import SchedulerOutput
from vbatch.engine.sequence import Sequence
from vbatch.errors import ConfigError
from vbatch.layers.attention import AttentionMetadata, get_attention_backend
from vbatch.models.config import ModelConfig
from vbatch.models.llama import load_model
from vbatch.models.loader import ResolvedModel
from vbatch.protocol import TokenLogprobs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_GB = 2.0


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmul is emulated and far slower there), bf16 on CUDA."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


@dataclass
class StepInputs:
    """One step's device tensors; `logits_rows[i]` is the hidden row sampled for seq
    `sample_rows[i]` (its last scheduled token)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [num_sampling_seqs] int64
    sample_rows: list[int]


class ModelRunner:
    """Owns the model weights and KV cache tensors of one engine core.

    Invariant: `kv_caches[layer]` is a (k_cache, v_cache) pair, each
    [num_kv_blocks, block_size, num_kv_heads, head_dim]; block ids handed out by the
    BlockManager index their first dimension.
    """

    def __init__(
        self,
        config: EngineConfig,
        resolved: ResolvedModel,
        model_config: ModelConfig,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        progress = on_progress or (lambda stage: None)
        self.config = config
        self.model_config = model_config
        self.device = select_device(config.device)
        self.dtype = select_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        progress("loading model")
        self.model = load_model(resolved, self.device, self.dtype, self.attn_backend, model_config)
        progress("sizing KV cache")
        self.num_kv_blocks = self._num_kv_blocks()
        shape = (
            self.num_kv_blocks,
            self.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        # NOTE: the torch backend's padded decode gather reads slots past a context, which must
        # then be finite; the native ops never do, so their cache skips touching every page.
        alloc = torch.zeros if self.attn_backend.name == "torch" else torch.empty
        self.kv_caches = [
            (
                alloc(shape, dtype=self.dtype, device=self.device),
                alloc(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(model_config.num_hidden_layers)
        ]
        self.kv_cache_bytes = self.num_kv_blocks * self.block_bytes
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        # [max rows sampled so far, vocab_size] float32 CPU logits, reused by every step
        self._logits = torch.empty(0, model_config.vocab_size)

    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (
            2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem
        )

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 1024**3
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # NOTE: keep 10% of the utilisation budget for activations and sampler buffers.
            budget = (total * self.config.gpu_memory_utilization - used) * 0.9
        else:
            available = psutil.virtual_memory().available
            budget = min(DEFAULT_CPU_KV_CACHE_GB * 1024**3, available * 0.25)
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 2:
            raise ConfigError(
                f"the KV-cache budget ({budget / 1024**2:.0f} MiB) holds fewer than 2 blocks of "
                f"{self.block_bytes / 1024**2:.2f} MiB; raise --kv-cache-memory"
            )
        return num_blocks

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """`array` on the runner's device; on CUDA through a reused pinned buffer, no sync."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        staging = self._staging.get(name)
        if staging is None or staging.numel() < tensor.numel() or staging.dtype != tensor.dtype:
            staging = torch.empty(max(tensor.numel(), 1024), dtype=tensor.dtype, pin_memory=True)
            self._staging[name] = staging
        host = staging[: tensor.numel()].view(tensor.shape)
        host.copy_(tensor)
        return host.to(self.device, non_blocking=True)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flat input ids, positions, attention metadata and logits rows for one step."""
        if self._inputs_copied is not None:
            # NOTE: the previous step's non-blocking copies may still read the pinned buffers
            # (a step that samples nothing ends without a sync); this waits for those copies only.
            self._inputs_copied.synchronize()
        seqs, num_new = out.seqs, out.num_new_tokens
        num_seqs = len(seqs)
        bs = self.block_size
        starts = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        query_lens = np.array(num_new, dtype=np.int64)
        seq_lens = starts + query_lens
        max_query_len = max(num_new)
        if max_query_len == 1:
            input_ids = np.array([s.token_ids[c] for s, c in zip(seqs, starts.tolist())])
            positions = starts
            seq_index = np.arange(num_seqs)
            num_tokens = num_seqs
        else:
            input_ids = np.fromiter(
                itertools.chain.from_iterable(
                    s.token_ids[c : c + n] for s, c, n in zip(seqs, starts.tolist(), num_new)
                ),
                np.int64,
            )
            num_tokens = len(input_ids)
            seq_index = np.repeat(np.arange(num_seqs), query_lens)
            offsets = np.arange(num_tokens) - np.repeat(
                np.cumsum(query_lens) - query_lens, query_lens
            )
            positions = starts[seq_index] + offsets
        num_blocks = np.array([len(s.block_table) for s in seqs])
        # [num_seqs, max_num_blocks_per_seq], 0-padded: row-major mask order = concatenation order
        block_tables = np.zeros((num_seqs, int(num_blocks.max())), dtype=np.int32)
        block_tables[np.arange(block_tables.shape[1]) < num_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(s.block_table for s in seqs),
            np.int32,
            int(num_blocks.sum()),
        )
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + (
            positions % bs
        )
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        sample_rows = np.flatnonzero(out.sampling_mask)
        meta = AttentionMetadata(
            slot_mapping=self._to_device("slot_mapping", slot_mapping),
            query_start_loc=self._to_device("query_start_loc", query_start_loc),
            seq_lens=self._to_device("seq_lens", seq_lens.astype(np.int32)),
            block_tables=self._to_device("block_tables", block_tables),
            query_lens_cpu=num_new,
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
        )
        inputs = StepInputs(
            input_ids=self._to_device("input_ids", input_ids),
            positions=self._to_device("positions", positions),
            meta=meta,
            logits_rows=self._to_device(
                "logits_rows", query_start_loc[1:][sample_rows].astype(np.int64) - 1
            ),
            sample_rows=sample_rows.tolist(),
        )
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return inputs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Run one step; returns the sampled token per sampling seq, in batch order."""
        inputs = self.prepare(out)
        if not inputs.sample_rows:
            self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            return [], None
        # NOTE: built before the forward is queued: on CUDA its host-to-device copies of Python
        # lists would otherwise wait for the forward to finish.
        sampling_seqs = [out.seqs[i] for i in inputs.sample_rows]
        sampling = self.sampling_metadata(sampling_seqs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(
            hidden.index_select(0, inputs.logits_rows), out=self._logits_buffer(len(sampling_seqs))
        )
        return self.sample(logits, sampling)

    def _logits_buffer(self, num_rows: int) -> torch.Tensor | None:
        if self.device.type != "cpu":
            return None
        if self._logits.shape[0] < num_rows:
            self._logits = torch.empty(num_rows, self.model_config.vocab_size)
        return self._logits[:num_rows]

    def sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        return SamplingMetadata.build(
            seqs,
            self.device,
            self.model_config.vocab_size,
            self.generators,
            self.model_config.eos_token_ids,
        )

    def sample(
        self, logits: torch.Tensor, sampling: SamplingMetadata
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per row of logits [num_rows, vocab_size]; the step's one host sync."""
        result = self.sampler(logits, sampling)
        return result.token_ids.tolist(), result.logprobs

    def release(self, seqs: list[Sequence]) -> None:
        free_generators(self.generators, (seq.seq_id for seq in seqs))
