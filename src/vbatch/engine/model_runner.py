"""ModelRunner: the model, the paged KV cache, batch tensors, one forward pass and sampling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vbatch.config import EngineConfig
from vbatch.engine.cpu_share import cpu_notes
from vbatch.engine.cuda_graphs import DecodeGraphRunner
from vbatch.engine.grammar import GrammarMasks, StepMask
from vbatch.engine.input_batch import (
    DecodeBatch,
    GatheredBlockTables,
    HostBatch,
    advance_host_arrays,
    build_host_batch,
)
from vbatch.engine.kv_cache import (
    allocate_kv_cache,
    count_kv_blocks,
    kv_block_bytes,
    select_device,
    select_dtype,
    select_kv_cache_dtype,
)
from vbatch.engine.sampler import Sampler, SamplerOutput
from vbatch.engine.sampling_metadata import SamplingMetadata, SeededUniforms, free_generators
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.errors import ConfigError
from vbatch.layers import get_attention_backend
from vbatch.layers.attention import AttentionMetadata
from vbatch.layers.batch_invariant import check_row_invariance, make_batch_invariant
from vbatch.layers.greedy_screen import (
    can_use_greedy_screen,
    choose_greedy_screen,
    describe_screen_choice,
    screen_sides,
)
from vbatch.layers.linear_choice import ChosenLinear, runs_at_any_thread_count, settle_linears
from vbatch.layers.native import has_fused_ops
from vbatch.layers.packed_store import PackedStore, store_path
from vbatch.layers.quantization import (
    WORTHWHILE_GEMM_SPEEDUP,
    WORTHWHILE_SPEEDUP,
    describe_int8_choice,
)
from vbatch.lora.slots import LoraSlots
from vbatch.models.config import ModelConfig
from vbatch.models.llama import load_model
from vbatch.models.loader import ResolvedModel
from vbatch.protocol import TokenLogprobs


@dataclass
class StepInputs:
    """One step's device tensors; `logits_rows[i]` is the hidden row sampled for seq
    `sample_rows[i]` (its last scheduled token)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [num_sampling_seqs] int64
    sample_rows: list[int]
    # NOTE: set when a seq runs on longrope's long factors: each token's offset into the rotary
    # tables (the model's long_rope_offset for such a seq, else 0), and positions plus it.
    rope_offsets: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None

    @property
    def model_positions(self) -> torch.Tensor:
        """What the model rotates by (see LlamaForCausalLM.long_rope_offset)."""
        return self.positions if self.rope_positions is None else self.rope_positions


class ModelRunner:
    """Owns the model weights and KV cache tensors of one engine core.

    Invariant: `kv_caches[layer]` is a (k_cache, v_cache) pair, each
    [num_kv_blocks + 1, block_size, num_kv_heads, head_dim] of kv_cache_dtype; block ids handed
    out by the BlockManager index their first dimension, and the last block (`pad_block`), which
    it never hands out, takes the writes of decode-graph padding rows.
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
        self.kv_cache_dtype = select_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        # NOTE: the native kernel's packed weights and the fused float32 projections, mapped
        # from disk where an earlier core wrote them (layers/packed_store.py).
        self.packed_store = PackedStore(None)
        if not config.batch_invariant and self.device.type == "cpu" and self.dtype == torch.float32:
            self.packed_store = PackedStore(store_path(resolved.weights_hash, self.dtype))
        progress("loading model")
        self.model = load_model(
            resolved,
            self.device,
            self.dtype,
            self.attn_backend,
            model_config,
            config.quantization,
            self.packed_store,
        )
        # NOTE: the kernels chosen, as text for the manifest and dashboard, and any warning.
        self.kernel_notes: list[str] = []
        self.kernel_warnings: list[str] = []
        # NOTE: set where every linear's bits are the same at any thread count (_choose_linears).
        self.thread_invariant = False
        choice = self.model.quantization_choice
        if choice and "backend" in choice:
            self.kernel_notes.append(describe_int8_choice(choice))
            if float(choice["speedup"]) < WORTHWHILE_GEMM_SPEEDUP:  # type: ignore[arg-type]
                self.kernel_warnings.append(
                    f"--quantization int8 may not make a job {WORTHWHILE_SPEEDUP:g}x faster than "
                    f"fp32 on this CPU: its layer GEMMs timed under {WORTHWHILE_GEMM_SPEEDUP:g}x "
                    "fp32, and attention and the LM head stay float32 "
                    f"({describe_int8_choice(choice)})"
                )
        has_lm_head = model_config.head == "lm"
        if config.batch_invariant:
            self._make_batch_invariant(model_config)
        elif self.device.type == "cpu" and self.dtype == torch.float32:
            self._choose_linears(config.linear_backend, has_lm_head, progress)
        screenable = has_lm_head and can_use_greedy_screen(self.device, self.dtype)
        if config.greedy_screen is not False and screenable and not config.batch_invariant:
            progress("choosing kernels")
            sides = None
            if config.greedy_screen is None:
                screen = choose_greedy_screen(
                    self.model.lm_head_weight, self.model._greedy_token_ids_fp32
                )
                sides = screen_sides(screen)
                self.kernel_notes.append(describe_screen_choice(screen, None))
            else:
                self.kernel_notes.append(describe_screen_choice({}, True))
            if sides is None or sides.gemms:
                self.model.enable_greedy_screen(self.packed_store, sides)
        self.lora: LoraSlots | None = None
        if config.enable_lora:
            self.lora = LoraSlots(self.model, model_config, config.max_loras, config.max_lora_rank)
        self.thread_invariant &= (
            self.lora is None
            and not any(model_config.moe_layers)
            and self.attn_backend.name == "native"
        )
        if self.device.type == "cpu":
            self.kernel_notes += cpu_notes(torch.get_num_threads(), self.thread_invariant)
        progress("sizing KV cache")
        self.block_bytes = kv_block_bytes(model_config, self.block_size, self.kv_cache_dtype)
        pending_copies = self.model.pending_copy_bytes() + sum(
            module.pending_copy_bytes()
            for module in self.model.modules()
            if isinstance(module, ChosenLinear)
        )
        self.num_kv_blocks = count_kv_blocks(
            config, self.device, self.block_bytes, reserved_bytes=pending_copies
        )
        self.pad_block = self.num_kv_blocks
        # NOTE: the torch backend's padded decode gather reads slots past a context, which must
        # then be finite; the native ops never do, so their cache skips touching every page.
        self.kv_caches = allocate_kv_cache(
            model_config,
            self.num_kv_blocks + 1,
            self.block_size,
            self.kv_cache_dtype,
            self.device,
            zeroed=self.attn_backend.name == "torch",
        )
        self.kv_cache_bytes = self.num_kv_blocks * self.block_bytes
        self.sampler = Sampler()
        self.grammar_masks = GrammarMasks(model_config.vocab_size)
        self.generators: dict[int, SeededUniforms] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._gathered = GatheredBlockTables()
        # NOTE: a kept decode batch takes the sampled ids as a tensor, on its device: on CPU
        # with the native op directly, elsewhere (`feeds_ids_on_device`) by a copy into the next
        # step's input ids, so a step can be launched before the last one's ids reach the host.
        self.feeds_ids_on_device = not has_fused_ops(self.device)
        self._decode = self._new_decode_batch()
        self._fed_input_ids: torch.Tensor | None = None
        # NOTE: on CPU, the view of a gathered block table, which steps often share.
        self._cpu_views: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        self._greedy_sampling: tuple[int, SamplingMetadata] | None = None  # (step_id, its meta)
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        # NOTE: on CPU a step's tensors are views of its HostBatch's buffers, so a batch advanced
        # in place keeps them valid; only its metadata's block tables and scalars move on.
        self._kept_inputs: tuple[HostBatch, StepInputs] | None = None
        # [max rows sampled so far, vocab_size] float32 CPU logits, reused by every step
        self._logits = torch.empty(0, model_config.vocab_size)
        self.graph_runner: DecodeGraphRunner | None = None
        # NOTE: the torch backend's decode gathers max_seq_len positions a row, which a graph
        # fixes at the model's whole length; the native op reads only each row's context. MoE
        # routing sizes its expert batches on the host, which a graph cannot capture. A step's
        # LoRA groups change its shapes, so adapters run eagerly too.
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.lora is None
            and self.attn_backend.name == "native"
            and self.model.supports_cuda_graphs
        ):
            progress("capturing CUDA graphs")
            max_position = model_config.max_position_embeddings
            max_model_len = min(config.max_model_len or max_position, max_position)
            self.graph_runner = DecodeGraphRunner(
                self.model,
                self.kv_caches,
                model_config.vocab_size,
                max_batch_size=min(config.max_num_seqs, config.max_graph_batch_size),
                max_num_blocks_per_seq=-(-max_model_len // self.block_size),
                pad_block=self.pad_block,
                use_graphs=True,
            )
            self.graph_runner.capture()

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """`array` on the runner's device: on CPU a view, reused while it is the same array; on
        CUDA through a reused pinned buffer, no sync."""
        if self.device.type == "cpu":
            kept = self._cpu_views.get(name)
            if kept is None or kept[0] is not array:
                kept = (array, torch.from_numpy(array))
                self._cpu_views[name] = kept
            return kept[1]
        tensor = torch.from_numpy(array)
        staging = self._staging.get(name)
        if staging is None or staging.numel() < tensor.numel() or staging.dtype != tensor.dtype:
            staging = torch.empty(max(tensor.numel(), 1024), dtype=tensor.dtype, pin_memory=True)
            self._staging[name] = staging
        host = staging[: tensor.numel()].view(tensor.shape)
        host.copy_(tensor)
        return host.to(self.device, non_blocking=True)

    def _split_to_device(
        self, name: str, array: np.ndarray, sizes: list[int]
    ) -> list[torch.Tensor]:
        """Consecutive pieces of `array` on the runner's device; on CUDA with one copy."""
        if self.device.type != "cpu":
            return list(self._to_device(name, array).split(sizes))
        # NOTE: on CPU a view per piece costs less than a torch split, which dispatches an op.
        pieces = []
        start = 0
        for size in sizes:
            pieces.append(torch.from_numpy(array[start : start + size]))
            start += size
        return pieces

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flat input ids, positions, attention metadata and logits rows for one step."""
        if self._inputs_copied is not None:
            # NOTE: the previous step's non-blocking copies may still read the pinned buffers
            # (a step that samples nothing ends without a sync); this waits for those copies only.
            self._inputs_copied.synchronize()
        host = build_host_batch(
            out, self.block_size, self._gathered, self._decode, self.config.batch_invariant
        )
        kept = self._kept_inputs
        if kept is not None and kept[0] is host:
            inputs = kept[1]
            inputs.meta.block_tables = self._to_device("block_tables", host.block_tables)
            inputs.meta.max_seq_len = host.max_seq_len
            inputs.meta.prompt_chunks = None
            self._feed_input_ids(inputs.input_ids)
            if inputs.rope_offsets is not None and inputs.rope_positions is not None:
                torch.add(inputs.positions, inputs.rope_offsets, out=inputs.rope_positions)
            return inputs
        n, num_seqs = host.num_tokens, len(out.seqs)
        input_ids, positions, slot_mapping, logits_rows = self._split_to_device(
            "int64s", host.int64s, [n, n, n, len(host.sample_rows)]
        )
        seq_lens, query_start_loc = self._split_to_device(
            "int32s", host.int32s, [num_seqs, num_seqs + 1]
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self._to_device("block_tables", host.block_tables),
            query_lens_cpu=out.num_new_tokens,
            seq_lens_cpu=host.seq_lens,
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
            prompt_chunks=None
            if host.prompt_chunks is None
            else torch.from_numpy(host.prompt_chunks),
        )
        self._feed_input_ids(input_ids)
        inputs = StepInputs(input_ids, positions, meta, logits_rows, host.sample_rows)
        long_offset = self.model.long_rope_offset
        if long_offset is not None and any(seq.long_rope for seq in out.seqs):
            per_seq = np.array([seq.long_rope for seq in out.seqs], dtype=np.int64) * long_offset
            offsets = np.repeat(per_seq, out.num_new_tokens)
            inputs.rope_offsets = self._to_device("rope_offsets", offsets)
            inputs.rope_positions = positions + inputs.rope_offsets
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        self._kept_inputs = (host, inputs) if self.device.type == "cpu" else None
        return inputs

    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Run one step; returns the sampled token per sampling seq, in batch order."""
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput) -> SamplerOutput | None:
        """Queue one step; its samples (None: it samples nothing) stay on the device until
        collect(). A step continuing this one may be launched before then (async scheduling)."""
        if torch.is_inference_mode_enabled():
            sampled = self._launch(out)
        else:
            # NOTE: the bare guard; torch.inference_mode()'s Python context manager costs ~45 µs
            # a step once a forward pass has evicted its code from the caches, the guard ~15.
            # The engine-core process runs its whole loop in inference mode and needs neither.
            guard = torch._C._InferenceMode(True)
            try:
                sampled = self._launch(out)
            finally:
                del guard
        if sampled is not None:
            self._decode.record(out.step_id, sampled.token_ids)
        return sampled

    def collect(
        self, sampled: SamplerOutput | None
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """A launched step's tokens and logprobs on the host; the step's one wait for the
        device."""
        if sampled is None:
            return [], None
        token_ids, logprobs = sampled.to_host()
        if sampled.grammar is not None:
            sampled.grammar.accept(token_ids)
        return token_ids, logprobs

    def _launch(self, out: SchedulerOutput) -> SamplerOutput | None:
        if out.kv_copies:
            self._copy_kv(out.kv_copies)
        inputs = self.prepare(out)
        if self.lora is not None:
            self.lora.prepare(out)
        if not inputs.sample_rows:
            self.model(inputs.input_ids, inputs.model_positions, self.kv_caches, inputs.meta)
            return None
        # NOTE: built before the forward is queued: on CUDA its host-to-device copies of Python
        # lists would otherwise wait for the forward to finish.
        sample_rows = inputs.sample_rows
        if len(sample_rows) == len(out.seqs):
            sampling_seqs = out.seqs
        else:
            sampling_seqs = [out.seqs[i] for i in sample_rows]
        sampling = self._step_sampling(out, sampling_seqs)
        mask = self.grammar_masks.start(sampling_seqs)
        if self.graph_runner is not None and self.graph_runner.can_run(inputs.meta):
            logits = self.graph_runner.run(
                inputs.input_ids, inputs.model_positions, inputs.meta, inputs.logits_rows
            )
            return self._sample(logits, sampling, mask, sampling_seqs)
        # NOTE: forward() itself: Module.__call__'s hook checks cost ~20 µs a step once a CPU
        # forward pass has evicted them from the caches, and nothing here registers hooks.
        hidden = self.model.forward(
            inputs.input_ids, inputs.model_positions, self.kv_caches, inputs.meta
        )
        if len(sample_rows) != hidden.shape[0]:
            # NOTE: when every row samples, logits_rows is 0..n-1 and the gather is a copy.
            hidden = hidden.index_select(0, inputs.logits_rows)
        if sampling.is_plain_greedy and mask is None:
            return SamplerOutput.of_token_ids(self.model.greedy_token_ids(hidden))
        logits = self.model.compute_logits(hidden, out=self._logits_buffer(len(sampling_seqs)))
        return self._sample(logits, sampling, mask, sampling_seqs)

    def _copy_kv(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first n token slots of block `source` to block `dest` in every layer."""
        for source, dest, n in copies:
            for k_cache, v_cache in self.kv_caches:
                k_cache[dest, :n] = k_cache[source, :n]
                v_cache[dest, :n] = v_cache[source, :n]

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: SamplingMetadata,
        mask: StepMask | None,
        seqs: list[Sequence],
    ) -> SamplerOutput:
        """Sample `logits` after the grammar mask, if any: constrained rows pick among the
        tokens their grammar allows, in every sampling mode (the int8 greedy screen is skipped).
        `seqs` are the rows' seqs, kept where a row may be left with no token."""
        if mask is not None:
            mask.apply(logits)
        sampled = self.sampler(logits, sampling)
        sampled.grammar = mask
        if sampled.exhausted is not None:
            sampled.row_seqs = seqs
        return sampled

    def _choose_linears(
        self, backend: str, has_lm_head: bool, progress: Callable[[str], None]
    ) -> None:
        """Run the float32 CPU linears by `backend`: torch's GEMM as built, oneDNN's, or (auto)
        the faster per projection and row class, measured here (layers/linear_choice.py)."""
        if backend == "auto":
            progress("choosing kernels")
        weights = self.model.linear_weights(with_head=has_lm_head)
        settled = settle_linears(backend, self.model, weights, swiglu=self.model.fuses_swiglu())
        if settled is not None:
            self.model.use_linear_choice(settled[0], self.packed_store)
            self.kernel_notes.append(settled[1])
            self.thread_invariant = runs_at_any_thread_count(settled[0])

    def _make_batch_invariant(self, model_config: ModelConfig) -> None:
        reasons = {
            "a float32 model on CPU": self.device.type != "cpu" or self.dtype != torch.float32,
            "the native attention kernels": self.attn_backend.name != "native",
            "a model without mixture-of-experts layers": any(model_config.moe_layers),
        }
        missing = [name for name, is_missing in reasons.items() if is_missing]
        if missing:
            raise ConfigError(f"batch_invariant needs {' and '.join(missing)}")
        shapes = make_batch_invariant(self.model.layers)
        if model_config.head == "lm":
            shapes.append(tuple(self.model.lm_head_weight.shape))
        check_row_invariance(shapes)
        self.model.is_batch_invariant = True
        self.kernel_notes.append("batch-invariant linears (oneDNN, row counts checked)")

    def _new_decode_batch(self) -> DecodeBatch:
        return DecodeBatch(
            self._advance_then_feed if self.feeds_ids_on_device else self._advance_native
        )

    def _advance_native(self, host: HostBatch, token_ids: torch.Tensor) -> None:
        """DecodeBatch's array update in one native call, on the kept step's tensor views (see
        SchedulerOutput, continuing decode steps)."""
        kept = self._kept_inputs
        assert kept is not None and kept[0] is host, "the advanced batch is the kept one"
        inputs = kept[1]
        torch.ops.vbatch.advance_decode(
            inputs.input_ids,
            inputs.positions,
            inputs.meta.slot_mapping,
            inputs.meta.seq_lens,
            token_ids,
            self._to_device("block_tables", host.block_tables),
            self.block_size,
        )

    def _advance_then_feed(self, host: HostBatch, token_ids: torch.Tensor) -> None:
        """DecodeBatch's update when the sampled ids may still be on the device: the host arrays
        move on without them, and prepare() copies them into the step's input ids."""
        advance_host_arrays(host, self.block_size)
        self._fed_input_ids = token_ids

    def _feed_input_ids(self, input_ids: torch.Tensor) -> None:
        fed = self._fed_input_ids
        if fed is not None:
            input_ids.copy_(fed)
            self._fed_input_ids = None

    def _step_sampling(self, out: SchedulerOutput, seqs: list[Sequence]) -> SamplingMetadata:
        """The sampling metadata of `seqs`, out's sampling seqs; a plain-greedy one is reused by
        the steps that continue its step, as nothing they change can make a seq sample otherwise."""
        kept = self._greedy_sampling
        if kept is not None and out.continues_step == kept[0]:
            sampling = kept[1]
        else:
            sampling = self.sampling_metadata(seqs)
        self._greedy_sampling = (out.step_id, sampling) if sampling.is_plain_greedy else None
        return sampling

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

    def reset_step_state(self) -> None:
        """Forget everything that lets a step reuse the last one's batch (after a step failed
        midway), and take up `feeds_ids_on_device`: the next step is built from its
        SchedulerOutput alone."""
        self._decode = self._new_decode_batch()
        self._fed_input_ids = None
        self._kept_inputs = None
        self._greedy_sampling = None

    def release(self, seqs: list[Sequence]) -> None:
        free_generators(self.generators, (seq.seq_id for seq in seqs))
