"""llama.cpp on the same GGUF and prompts: continuous batching through llama-cpp-python's C API.

An optional benchmark dependency, never a runtime one. `llama-cpp-python` builds from source
(about 5 minutes on 2 cores); install it somewhere apart, e.g.
`pip install --no-deps --target /tmp/lcp llama-cpp-python diskcache`, then run

    PYTHONPATH=/tmp/lcp python -m benchmarks.llamacpp_batched [--num-prompts 128]
        [--max-tokens 128] [--threads 2] [--max-num-seqs 64]

It keeps up to --max-num-seqs sequences in one unified KV cache, feeds each step's decode tokens
and any newly admitted prompt in one `llama_decode` call (up to 2048 tokens), samples greedily
(argmax, as vbatch and HF generate do in the other benchmarks) and frees a finished sequence's
cache for the next prompt. The model runs in the GGUF's own quantization (Q4_1 for the default).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections import deque
from pathlib import Path

import numpy as np

from benchmarks.workload import make_messages
from vbatch.client.tokenizer import TextTokenizer
from vbatch.models.loader import resolve_model

MAX_BATCH_TOKENS = 2048


class LlamaCppBatch:
    """One llama.cpp model and context with `max_num_seqs` sequence slots (llama_cpp C API)."""

    def __init__(self, gguf: Path, max_num_seqs: int, max_context: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(self.vocab)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = max_num_seqs * max_context
        ctx_params.n_batch = MAX_BATCH_TOKENS
        ctx_params.n_ubatch = 512
        ctx_params.n_seq_max = max_num_seqs
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        if hasattr(ctx_params, "kv_unified"):
            ctx_params.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context with these settings")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(MAX_BATCH_TOKENS, 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq slot, wants logits)."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, slot, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = wants_logits
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, batch_index: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, batch_index)
        logits = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
        row = np.ctypeslib.as_array(logits, (self.vocab_size,))
        return int(row.argmax())

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def free_slot(self, slot: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, slot, -1, -1)


def generate(
    engine: LlamaCppBatch, prompts: list[list[int]], max_tokens: int, max_num_seqs: int
) -> list[list[int]]:
    """Greedy continuations, continuous batching over `max_num_seqs` slots."""
    waiting = deque(range(len(prompts)))
    free_slots = list(range(max_num_seqs))
    running: dict[int, int] = {}  # slot -> prompt index
    outputs: list[list[int]] = [[] for _ in prompts]
    pending_prompt: dict[int, int] = {}  # slot -> prompt tokens already fed
    while waiting or running:
        while waiting and free_slots:
            slot = free_slots.pop()
            running[slot] = waiting.popleft()
            pending_prompt[slot] = 0
        entries: list[tuple[int, int, int, bool]] = []
        samplers: list[tuple[int, int]] = []  # (batch index, slot)
        for slot, index in running.items():
            if slot in pending_prompt:
                continue
            out = outputs[index]
            entries.append((out[-1], len(prompts[index]) + len(out) - 1, slot, True))
            samplers.append((len(entries) - 1, slot))
        for slot in list(pending_prompt):
            prompt = prompts[running[slot]]
            done = pending_prompt[slot]
            room = MAX_BATCH_TOKENS - len(entries)
            if room <= 0:
                break
            chunk = prompt[done : done + room]
            for j, token in enumerate(chunk):
                is_last = done + j == len(prompt) - 1
                entries.append((token, done + j, slot, is_last))
            if done + len(chunk) == len(prompt):
                del pending_prompt[slot]
                samplers.append((len(entries) - 1, slot))
            else:
                pending_prompt[slot] = done + len(chunk)
        engine.decode(entries)
        for batch_index, slot in samplers:
            index = running[slot]
            token = engine.argmax(batch_index)
            outputs[index].append(token)
            if engine.is_eog(token) or len(outputs[index]) >= max_tokens:
                del running[slot]
                engine.free_slot(slot)
                free_slots.append(slot)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    resolved = resolve_model(None)
    tokenizer = TextTokenizer.from_dir(resolved.hf_dir)
    prompts = tokenizer.encode_chats(make_messages(args.num_prompts))
    max_context = max(map(len, prompts)) + args.max_tokens + 1
    engine = LlamaCppBatch(Path(resolved.source), args.max_num_seqs, max_context, args.threads)
    start = time.perf_counter()
    outputs = generate(engine, prompts, args.max_tokens, args.max_num_seqs)
    wall = time.perf_counter() - start
    num_out = sum(map(len, outputs))
    print(
        f"llama.cpp ({Path(resolved.source).name}, {args.max_num_seqs} slots, "
        f"{args.threads} threads): {num_out} output tokens in {wall:.1f} s, "
        f"{num_out / wall:.1f} output tok/s"
    )


if __name__ == "__main__":
    main()
