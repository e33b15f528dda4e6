"""Tests for the job manifest: input fingerprints, model identity, save/load, resume checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from helpers import STANDIN_GGUF, add_to_hub_cache

from vbatch import __version__
from vbatch.errors import JobStateError
from vbatch.job.manifest import (
    MANIFEST_VERSION,
    JobOptions,
    Manifest,
    ModelIdentity,
    input_fingerprint,
    model_identity,
)
from vbatch.job.options import RunOptions
from vbatch.job.rows import ColumnOptions


def make_manifest(input_path: Path, weights_hash: str = "w1") -> Manifest:
    return Manifest(
        vbatch_version=__version__,
        input_path=str(input_path),
        input_format="jsonl",
        input=input_fingerprint(input_path),
        num_rows=3,
        id_kind="int",
        output_path="/tmp/out.jsonl",
        output_format="jsonl",
        model=ModelIdentity(source="/m", name="m", weights_hash=weights_hash, files={}),
        engine={},
        sampling={"max_tokens": 4},
        options=JobOptions(),
        manifest_version=MANIFEST_VERSION,
    )


def test_fingerprint_ignores_mtime_but_sees_content(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    data = bytearray(os.urandom(5 << 20))
    path.write_bytes(data)
    first = input_fingerprint(path)
    os.utime(path, (1, 1))
    assert input_fingerprint(path).sampled_sha256 == first.sampled_sha256
    data[100] ^= 1
    path.write_bytes(data)
    assert input_fingerprint(path).sampled_sha256 != first.sampled_sha256
    data[100] ^= 1
    data[-5] ^= 1
    path.write_bytes(data)
    assert input_fingerprint(path).sampled_sha256 != first.sampled_sha256
    path.write_bytes(data + b"\n")
    assert input_fingerprint(path).size == first.size + 1


def test_save_load_round_trip_and_mismatches(tmp_path: Path) -> None:
    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"prompt": "a"}\n')
    manifest = make_manifest(input_path)
    manifest.save(tmp_path)
    loaded = Manifest.load(tmp_path)
    assert loaded == manifest
    same_model = ModelIdentity(source="/m", name="m", weights_hash="w1", files={})
    assert loaded.mismatches(input_fingerprint(input_path), same_model) == []
    input_path.write_text('{"prompt": "b"}\n')
    other_model = ModelIdentity(source="/m", name="m", weights_hash="w2", files={})
    reasons = loaded.mismatches(input_fingerprint(input_path), other_model)
    assert len(reasons) == 2
    assert "changed content" in reasons[0] and "model weights changed" in reasons[1]
    input_path.write_text('{"prompt": "bb"}\n')
    assert "changed size" in loaded.mismatches(input_fingerprint(input_path), same_model)[0]


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(JobStateError, match="not a vbatch job"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(JobStateError, match="unreadable"):
        Manifest.load(tmp_path)


# NOTE: as vbatch 0.1.0 wrote it at manifest version 2, before the manifest was typed.
VERSION_2_MANIFEST = {
    "vbatch_version": "0.1.0",
    "input_path": "/data/in.jsonl",
    "input_format": "jsonl",
    "input": {"size": 17, "mtime_ns": 1764600000000000000, "sampled_sha256": "ab" * 32},
    "num_rows": 1,
    "id_kind": "int",
    "output_path": "/data/out.jsonl",
    "output_format": "jsonl",
    "model": {
        "source": "/models/tiny",
        "name": "tiny",
        "weights_hash": "cd" * 32,
        "files": {"config.json": "ef" * 32},
    },
    "engine": {"max_num_seqs": 8},
    "sampling": {"max_tokens": 4},
    "options": {
        "columns": {
            "prompt_column": "text",
            "messages_column": None,
            "id_column": None,
            "keep_columns": ["a"],
            "keep_all_columns": False,
        },
        "ordered": True,
        "include_token_ids": True,
        "parse_json": False,
        "openai_output": False,
        "commit_every_rows": 7,
        "commit_every_seconds": 5.0,
        "max_errors": 0.5,
        "drain_timeout": 30.0,
        "max_in_flight": None,
    },
    "created": 1764600000.5,
    "manifest_version": 2,
}


def test_a_version_2_manifest_loads_typed_and_saves_unchanged(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(VERSION_2_MANIFEST))
    manifest = Manifest.load(tmp_path)
    assert manifest.options.columns == ColumnOptions(prompt_column="text", keep_columns=("a",))
    assert manifest.options.ordered and manifest.options.include_token_ids
    assert manifest.model.name == "tiny" and manifest.input.size == 17
    options = manifest.options.run_options({"max_in_flight": 3})
    assert options == RunOptions(commit_every_rows=7, max_errors=0.5, max_in_flight=3)
    manifest.save(tmp_path)
    # NOTE: options added since are written with their defaults; nothing else changes.
    added = {
        "chat_template_kwargs": None,
        "reasoning_parser": None,
        "openai_defaults": {},
        "require_valid_json": False,
        "task": "generate",
        "dimensions": None,
        "served_model_names": [],
        "data_parallel_size": 1,
        "ray": None,
    }
    expected = {**VERSION_2_MANIFEST, "options": {**VERSION_2_MANIFEST["options"], **added}}
    saved = json.loads((tmp_path / "manifest.json").read_text())
    assert saved.pop("checksum") == manifest.digest()
    assert saved == expected


def test_a_manifest_changed_outside_vbatch_is_refused(tmp_path: Path) -> None:
    """Valid JSON, other content: 50 rows where 120 were counted once ran 50 and exited 0."""
    (tmp_path / "manifest.json").write_text(json.dumps(VERSION_2_MANIFEST))
    Manifest.load(tmp_path).save(tmp_path)
    assert Manifest.load(tmp_path).num_rows == VERSION_2_MANIFEST["num_rows"]
    for field, value in (("num_rows", 2), ("output_format", "parquet")):
        saved = json.loads((tmp_path / "manifest.json").read_text())
        (tmp_path / "manifest.json").write_text(json.dumps({**saved, field: value}))
        with pytest.raises(JobStateError, match="was changed outside vbatch"):
            Manifest.load(tmp_path)
        (tmp_path / "manifest.json").write_text(json.dumps(saved))
        assert Manifest.load(tmp_path).checksum == saved["checksum"]


def test_a_manifest_it_cannot_read_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({**VERSION_2_MANIFEST, "manifest_version": 3}))
    with pytest.raises(JobStateError, match="written by a newer vbatch \\(manifest version 3"):
        Manifest.load(tmp_path)
    bad = {**VERSION_2_MANIFEST, "options": {**VERSION_2_MANIFEST["options"], "ordered": "yes"}}
    path.write_text(json.dumps(bad))
    with pytest.raises(JobStateError, match=r"unreadable .*Expected `bool`.*options.ordered"):
        Manifest.load(tmp_path)


def test_model_identity_hashes_safetensors_of_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    first = model_identity(str(tmp_path))
    assert first.source == str(tmp_path) and first.name == tmp_path.name
    (tmp_path / "model.safetensors").write_bytes(b"weights-two")
    assert model_identity(str(tmp_path)).weights_hash != first.weights_hash


def test_model_identity_covers_tokenizer_template_and_configs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "README.md").write_text("not part of the identity")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    first = model_identity(str(tmp_path))
    assert sorted(first.files or {}) == [
        "additional_chat_templates/tool_use.jinja",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
    ]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"prompt": "a"}\n')
    manifest = make_manifest(input_path, first.weights_hash)
    manifest.model = first
    fingerprint = input_fingerprint(input_path)
    (tmp_path / "README.md").write_text("edited")
    assert manifest.mismatches(fingerprint, model_identity(str(tmp_path))) == []

    (tmp_path / "chat_template.jinja").write_text("{{ messages[0] }}")
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "special_tokens_map.json").write_text("{}")
    (reason,) = manifest.mismatches(fingerprint, model_identity(str(tmp_path)))
    assert reason == (
        f"model files changed ({tmp_path}: chat_template.jinja changed, "
        "generation_config.json removed, special_tokens_map.json added)"
    )

    # NOTE: an embedder's pooling: its modules, their configs, its longest prompt.
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    (tmp_path / "modules.json").write_text(
        '[{"path": "", "type": "sentence_transformers.models.Transformer"}, '
        '{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]'
    )
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 64}')
    embedder = model_identity(str(tmp_path))
    assert {"1_Pooling/config.json", "modules.json", "sentence_bert_config.json"} <= set(
        embedder.files or {}
    )
    manifest.model = embedder
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 8}')
    (reason,) = manifest.mismatches(fingerprint, model_identity(str(tmp_path)))
    assert reason == (
        f"model files changed ({tmp_path}: 1_Pooling/config.json changed, "
        "sentence_bert_config.json changed)"
    )

    # NOTE: a manifest written before model files were recorded is read, and asks for --force.
    manifest.model = msgspec.structs.replace(first, files=None)
    manifest.save(tmp_path)
    (reason,) = Manifest.load(tmp_path).mismatches(fingerprint, first)
    assert "did not record the model's tokenizer, chat template and generation config" in reason


def test_model_identity_of_a_gguf_file_is_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(STANDIN_GGUF)
    assert model_identity(str(path)).files == {}


def test_model_identity_covers_the_shards_the_index_names(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"shard-1")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"shard-2")
    (tmp_path / "consolidated.safetensors").write_bytes(b"the same weights, another layout")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    first = model_identity(str(tmp_path))
    (tmp_path / "consolidated.safetensors").write_bytes(b"not loaded")
    assert model_identity(str(tmp_path)).weights_hash == first.weights_hash
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"shard-2 changed")
    assert model_identity(str(tmp_path)).weights_hash != first.weights_hash


def test_model_identity_of_a_hub_id_records_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"weights")
    (model_dir / "tokenizer.json").write_text("{}")
    snapshot = add_to_hub_cache(tmp_path / "hub", "org/m", model_dir, "1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    first = model_identity("org/m")
    by_path = model_identity(str(snapshot))
    assert first == msgspec.structs.replace(
        by_path, source="org/m", name="org/m", repo_id="org/m", revision=None, commit="1" * 40
    )
    assert sorted(first.files) == ["config.json", "tokenizer.json"]
    assert model_identity("org/m@" + "1" * 40).revision == "1" * 40

    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"prompt": "a"}\n')
    manifest = make_manifest(input_path)
    manifest.model = first
    fingerprint = input_fingerprint(input_path)
    add_to_hub_cache(tmp_path / "hub", "org/m", model_dir, "2" * 40)
    (reason,) = manifest.mismatches(fingerprint, model_identity("org/m"))
    assert reason == (
        f"model org/m now resolves to snapshot {'2' * 40} of the Hugging Face cache, not "
        f"{'1' * 40}, with the same weight, config and tokenizer files"
    )
    (model_dir / "tokenizer.json").write_text('{"changed": true}')
    add_to_hub_cache(tmp_path / "hub", "org/m", model_dir, "3" * 40)
    snapshot_moved, files_changed = manifest.mismatches(fingerprint, model_identity("org/m"))
    assert snapshot_moved.startswith(f"model org/m now resolves to snapshot {'3' * 40} ")
    assert snapshot_moved.endswith(f"not {'1' * 40}")
    assert files_changed == "model files changed (org/m: tokenizer.json changed)"
