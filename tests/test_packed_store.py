"""The packed-weight store: a later core maps the native copies and the fused float32
projections an earlier one wrote, gets the same results, and packs or copies afresh from a file
it cannot trust."""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import greedy_run, native_core
from safetensors import safe_open

from vbatch.layers import native, packed_store
from vbatch.layers.greedy_screen import HEAD_NAMES, can_use_greedy_screen
from vbatch.layers.packed_store import PackedStore, store_path, write_safetensors

PROMPT = list(range(100, 140))
# NOTE: the tiny model's two layers, four linears each.
LINEARS = {
    f"layers.{i}.{name}" for i in range(2) for name in ("qkv", "o", "gate_up.swiglu", "down")
}
FUSED = {
    f"fp32.layers.{i}.{name}.weight"
    for i in range(2)
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj")
}


@pytest.fixture()
def store_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if not native.is_available():
        pytest.skip("needs the native kernels")
    monkeypatch.setattr(packed_store, "store_root", lambda: tmp_path)
    return tmp_path


def run(model_dir: Path, screen: bool = False) -> tuple[list[int], list[float], PackedStore]:
    """A greedy run with logprobs on a fresh core whose linears run natively (and greedy tokens
    come from the int8 screen with `screen`); its store once the core has shut down (any write
    finished)."""
    core = native_core(model_dir, greedy_screen=screen)
    tokens, logprobs = greedy_run(core, PROMPT)
    core.shutdown()
    return tokens, logprobs, core.runner.packed_store


def test_a_later_core_maps_the_copies_an_earlier_one_wrote(
    store_root: Path, tiny_model_dir: Path
) -> None:
    tokens, logprobs, first = run(tiny_model_dir)
    assert not first.mapped_names
    (path,) = store_root.glob("*.safetensors")
    assert path == first.path
    again_tokens, again_logprobs, second = run(tiny_model_dir)
    assert second.mapped_names >= LINEARS
    assert again_tokens == tokens and again_logprobs == logprobs
    assert list(store_root.iterdir()) == [path]


def test_the_int8_screens_head_is_kept_and_checked_too(
    store_root: Path, tiny_model_dir: Path
) -> None:
    if not can_use_greedy_screen(torch.device("cpu"), torch.float32):
        pytest.skip("needs torch's int8 GEMM")
    tokens, _, first = run(tiny_model_dir, screen=True)
    assert first.path is not None and not first.mapped_names
    again_tokens, _, second = run(tiny_model_dir, screen=True)
    assert second.mapped_names == LINEARS | FUSED | set(HEAD_NAMES)
    assert again_tokens == tokens
    # NOTE: copies, written beside the file and renamed over it, as the store does: rewriting a
    # mapped file in place would pull the pages from under its mappings.
    tensors = {name: t.clone() for name, t in PackedStore(first.path)._mapped.items()}
    tensors[HEAD_NAMES[0]].neg_()
    write_safetensors(store_root / "replacement", tensors)
    (store_root / "replacement").replace(first.path)
    third_tokens, _, third = run(tiny_model_dir, screen=True)
    assert third.mapped_names == LINEARS | FUSED
    assert third_tokens == tokens


def test_a_corrupt_file_is_packed_afresh_and_written_again(
    store_root: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens, logprobs, first = run(tiny_model_dir)
    assert first.path is not None
    first.path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with caplog.at_level(logging.WARNING, logger="vbatch.layers.packed_store"):
        again_tokens, again_logprobs, second = run(tiny_model_dir)
    assert "ignoring the packed-weight cache" in caplog.text
    assert not second.mapped_names
    assert again_tokens == tokens and again_logprobs == logprobs
    assert run(tiny_model_dir)[2].mapped_names >= LINEARS


def damage(path: Path, name: str, start: int, size: int) -> None:
    """Overwrites `size` bytes of tensor `name` in the store's file, from byte `start` of its
    data, in place (as a disk fault or a torn write would leave it)."""
    with path.open("r+b") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(header_size))[name]["data_offsets"]
        assert start + size <= end - begin
        f.seek(8 + header_size + begin + start)
        flipped = bytes(255 - b for b in f.read(size))
        f.seek(8 + header_size + begin + start)
        f.write(flipped)


@pytest.mark.parametrize("name", ["layers.1.down", "fp32.layers.0.self_attn.qkv_proj.weight"])
def test_a_copy_damaged_in_place_is_packed_afresh_and_the_file_repaired(
    store_root: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """Bytes of one copy changed where its check against the weight does not look (a fused
    projection's second row; a packed linear's second panel): its checksum catches it."""
    tokens, logprobs, first = run(tiny_model_dir)
    assert first.path is not None
    row_bytes = PackedStore(first.path)._mapped[name].shape[-1] * 4
    damage(first.path, name, row_bytes, 64)
    with caplog.at_level(logging.WARNING, logger="vbatch.layers.packed_store"):
        again_tokens, again_logprobs, second = run(tiny_model_dir)
    assert f"is damaged ({name} does not match its checksum)" in caplog.text
    assert second.mapped_names >= (LINEARS | FUSED) - {name}
    assert name not in second.mapped_names
    assert again_tokens == tokens and again_logprobs == logprobs
    assert run(tiny_model_dir)[2].mapped_names >= LINEARS | FUSED


def test_copies_that_do_not_compute_their_layer_are_not_used(
    store_root: Path, tiny_model_dir: Path
) -> None:
    """A file under the right name whose tensors have the right shapes but other values (as a
    stale or mixed-up cache would): every copy fails its check and is packed afresh."""
    tokens, logprobs, first = run(tiny_model_dir)
    assert first.path is not None
    mapped = PackedStore(first.path)._mapped
    assert mapped.keys() == LINEARS | FUSED
    generator = torch.Generator().manual_seed(0)
    write_safetensors(
        store_root / "replacement",
        {name: torch.randn(t.shape, generator=generator) for name, t in mapped.items()},
    )
    (store_root / "replacement").replace(first.path)
    again_tokens, again_logprobs, second = run(tiny_model_dir)
    assert not second.mapped_names
    assert again_tokens == tokens and again_logprobs == logprobs


def fused_checkpoint_weights(model_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s fused projections as the checkpoint's parts give them, by store name."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        qkv = [f.get_tensor(f"model.layers.{layer}.self_attn.{p}_proj.weight") for p in "qkv"]
        mlp = [f.get_tensor(f"model.layers.{layer}.mlp.{p}_proj.weight") for p in ("gate", "up")]
    return {
        f"fp32.layers.{layer}.self_attn.qkv_proj.weight": torch.cat(qkv),
        f"fp32.layers.{layer}.mlp.gate_up_proj.weight": torch.cat(mlp),
    }


def test_the_fused_projections_are_the_stores_mapped_copies(
    store_root: Path, tiny_model_dir: Path
) -> None:
    first = native_core(tiny_model_dir, greedy_screen=False)
    greedy_run(first, PROMPT)
    first.shutdown()
    core = native_core(tiny_model_dir, greedy_screen=False)
    store = core.runner.packed_store
    assert store.mapped_names >= FUSED
    layer = core.runner.model.layers[1]
    weights = {
        "fp32.layers.1.self_attn.qkv_proj.weight": layer.self_attn.qkv_proj.weight,
        "fp32.layers.1.mlp.gate_up_proj.weight": layer.mlp.gate_up_proj.weight,
    }
    for name, expected in fused_checkpoint_weights(tiny_model_dir, 1).items():
        assert weights[name].data_ptr() == store._mapped[name].data_ptr()
        assert torch.equal(weights[name], expected)
    core.shutdown()


@pytest.mark.parametrize("row", ["first", "middle", "last"])
def test_a_fused_copy_that_differs_from_a_part_is_copied_afresh(
    store_root: Path, tiny_model_dir: Path, row: str
) -> None:
    """One row of the stored qkv projection changed, at a row of a part (here v_proj's) that
    the load checks: that projection is assembled from the checkpoint again, the others mapped."""
    tokens, logprobs, first = run(tiny_model_dir)
    assert first.path is not None
    tensors = {name: t.clone() for name, t in PackedStore(first.path)._mapped.items()}
    name = "fp32.layers.0.self_attn.qkv_proj.weight"
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        v_rows = f.get_slice("model.layers.0.self_attn.v_proj.weight").get_shape()[0]
    v_start = tensors[name].shape[0] - v_rows
    tensors[name][v_start + {"first": 0, "middle": v_rows // 2, "last": v_rows - 1}[row]] += 1.0
    write_safetensors(store_root / "replacement", tensors)
    (store_root / "replacement").replace(first.path)
    core = native_core(tiny_model_dir, greedy_screen=False)
    assert core.runner.packed_store.mapped_names >= FUSED - {name}
    assert name not in core.runner.packed_store.mapped_names
    weight = core.runner.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(weight, fused_checkpoint_weights(tiny_model_dir, 0)[name])
    assert greedy_run(core, PROMPT) == (tokens, logprobs)
    core.shutdown()


def test_a_copy_asked_for_is_checked_at_once_not_after_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 head, asked for while the model was built, waited for the checks of every
    linear queued ahead of it: 0.1-0.2 s of each start with the greedy screen."""
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(3)}
    write_safetensors(tmp_path / "store.safetensors", tensors)
    release = threading.Event()
    real_checksum = packed_store.checksum

    def held_in_the_checker(tensor: torch.Tensor) -> int:
        if threading.current_thread().name.startswith("vbatch-packed-check"):
            release.wait(30)
        return real_checksum(tensor)

    monkeypatch.setattr(packed_store, "checksum", held_in_the_checker)
    store = PackedStore(tmp_path / "store.safetensors")
    start = time.monotonic()
    (got,) = store.tensors(("t2",), lambda: (torch.zeros(4),), lambda mapped: True)
    assert time.monotonic() - start < 10
    assert torch.equal(got, tensors["t2"]) and store.mapped_names == {"t2"}
    release.set()
    store.close()


def test_the_path_tracks_the_weights_the_library_and_the_model_code(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = store_path("a" * 64, torch.float32)
    assert base is not None and base.parent == store_root
    assert store_path("b" * 64, torch.float32) != base
    assert store_path("a" * 64, torch.bfloat16) != base
    monkeypatch.setattr(packed_store, "models_source_digest", lambda: "other code")
    assert store_path("a" * 64, torch.float32) != base
    monkeypatch.setattr(native, "library_key", lambda: None)
    assert store_path("a" * 64, torch.float32) is None


def test_another_cpu_class_s_file_is_kept_and_a_superseded_one_removed(
    store_root: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes of two CPU classes sharing one cache: each write removed every other file of the
    model, so the classes deleted each other's and packed afresh at every switch."""
    first = run(tiny_model_dir)[2].path
    assert first is not None
    legacy = store_root / f"{first.name[:16]}-{'0' * 16}.safetensors"
    legacy.write_bytes(b"a file of the two-part naming")
    library = native.library_key()
    monkeypatch.setattr(native, "library_key", lambda: f"{library} on another CPU")
    other_class = run(tiny_model_dir)[2].path
    assert other_class is not None and other_class != first
    assert first.exists() and not legacy.exists()
    monkeypatch.setattr(native, "library_key", lambda: library)
    monkeypatch.setattr(packed_store, "models_source_digest", lambda: "newer model code")
    newer = run(tiny_model_dir)[2].path
    assert sorted(store_root.glob("*.safetensors")) == sorted([other_class, newer])


def test_a_cache_that_cannot_be_written_costs_one_warning(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not native.is_available():
        pytest.skip("needs the native kernels")
    blocked = tmp_path / "a-file-where-the-directory-should-be"
    blocked.write_text("")
    monkeypatch.setattr(packed_store, "store_root", lambda: blocked)
    with caplog.at_level(logging.WARNING, logger="vbatch.layers.packed_store"):
        tokens, _, store = run(tiny_model_dir)
    assert tokens and store.path is None
    assert caplog.text.count("could not write the packed-weight cache") == 1
