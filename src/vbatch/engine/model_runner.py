"""ModelRunner: the model, the paged KV cache, batch tensors, one forward pass and sampling."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
        self.model = load_model(resolved, self.device, self.dtype, self.attn_backend)
        progress("sizing KV cache")
        self.num_kv_blocks = self._num_kv_blocks()
        shape = (
            self.num_kv_blocks,
            self.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(model_config.num_hidden_layers)
        ]
        self.kv_cache_bytes = self.num_kv_blocks * self.block_bytes
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self._pin = self.device.type == "cuda"

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

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        if self._pin:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids, positions and attention metadata for one scheduled step."""
        seqs, num_new = out.seqs, out.num_new_tokens
        bs = self.block_size
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
        query_lens = np.asarray(num_new, dtype=np.int64)
        seq_lens = starts + query_lens
        num_tokens = int(query_lens.sum())
        if int(query_lens.max()) == 1:
            input_ids = np.fromiter(
                (s.token_ids[c] for s, c in zip(seqs, starts.tolist())), np.int64, len(seqs)
            )
            positions = starts
            seq_index = np.arange(len(seqs))
        else:
            ids: list[int] = []
            for seq, start, n in zip(seqs, starts.tolist(), num_new):
                ids.extend(seq.token_ids[start : start + n])
            input_ids = np.asarray(ids, dtype=np.int64)
            seq_index = np.repeat(np.arange(len(seqs)), query_lens)
            offsets = np.arange(num_tokens) - np.repeat(
                np.cumsum(query_lens) - query_lens, query_lens
            )
            positions = starts[seq_index] + offsets
        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_table)] = seq.block_table
        slot_mapping = (
            block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        )
        query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(block_tables),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return self._to_device(input_ids), self._to_device(positions), meta

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Run one step; returns the sampled token per sampling seq, in batch order."""
        input_ids, positions, meta = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sample_rows = [
            i
            for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens))
            if seq.num_computed_tokens + n == seq.num_tokens
        ]
        if not sample_rows:
            return [], None
        sampling_seqs = [out.seqs[i] for i in sample_rows]
        last_rows = meta.query_start_loc[1:][torch.as_tensor(sample_rows, device=self.device)] - 1
        logits = self.model.compute_logits(hidden[last_rows.long()])
        return self.sample(logits, sampling_seqs)

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per row of logits [len(seqs), vocab_size]."""
        sampling = SamplingMetadata.build(
            seqs,
            self.device,
            self.model_config.vocab_size,
            self.generators,
            self.model_config.eos_token_ids,
        )
        result = self.sampler(logits, sampling)
        return result.token_ids.tolist(), result.logprobs

    def release(self, seqs: list[Sequence]) -> None:
        free_generators(self.generators, (seq.seq_id for seq in seqs))
