"""Hub ids resolved from a Hugging Face cache laid out as `hf download` leaves it (blobs,
snapshots of symlinks, refs), never fetched: resolution, the missing-model error, a job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import add_to_hub_cache, read_jsonl, write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.errors import ModelLoadError
from vbatch.job.runner import job_dir_for
from vbatch.models.hub import hub_cache_dir, parse_hub_id
from vbatch.models.loader import resolve_model

MAIN = "1" * 40
TAGGED = "2" * 40
REPO = "org/tiny-llama"


@pytest.fixture
def hf_home(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$HF_HOME whose hub cache holds REPO: main at MAIN, tag v1 at TAGGED."""
    home = tmp_path / "hf-home"
    add_to_hub_cache(home / "hub", REPO, tiny_model_dir, MAIN)
    add_to_hub_cache(home / "hub", REPO, tiny_model_dir, TAGGED, ref="v1")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    return home


def test_parse_hub_id() -> None:
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("Qwen/Qwen3-0.6B@main") == ("Qwen/Qwen3-0.6B", "main")
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_an_id in ("gpt2", "./org/name", "../org/name", "/abs/name", "~/org/name", "a/b/c"):
        assert parse_hub_id(not_an_id) is None, not_an_id
    assert parse_hub_id("models/model.gguf") is None


def test_hub_cache_dir_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_hub_id_resolves_to_its_cached_snapshot(
    hf_home: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo_dir = hf_home / "hub" / "models--org--tiny-llama"
    resolved = resolve_model(REPO)
    assert resolved.hf_dir == repo_dir / "snapshots" / MAIN
    assert resolved.local_path == resolved.hf_dir
    assert (resolved.source, resolved.name, resolved.is_gguf) == (REPO, REPO, False)
    assert resolved.hub is not None
    assert (resolved.hub.repo_id, resolved.hub.revision, resolved.hub.commit) == (REPO, None, MAIN)
    assert (resolved.hf_dir / "model.safetensors").is_symlink()
    assert resolved.weights_hash == resolve_model(tiny_model_dir).weights_hash
    tagged = resolve_model(f"{REPO}@v1")
    assert tagged.hf_dir == repo_dir / "snapshots" / TAGGED
    assert tagged.source == f"{REPO}@v1" and tagged.name == REPO
    (repo_dir / "refs" / "v1").unlink()
    pinned = resolve_model(f"{REPO}@{TAGGED}")
    assert pinned.hf_dir == repo_dir / "snapshots" / TAGGED and pinned.hub.commit == TAGGED
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO) == resolved
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    assert resolve_model(REPO) == resolved


def test_resolution_opens_no_socket(hf_home: Path) -> None:
    """In a fresh process, so that importing huggingface_hub counts too, and without
    HF_HUB_OFFLINE: finding a cached model and missing an absent one touch no network."""
    code = (
        "import sys\n"
        "events = []\n"
        "sys.addaudithook(lambda e, a: e.startswith('socket.') and events.append(e))\n"
        "from vbatch.models.loader import resolve_model\n"
        f"print(resolve_model({REPO!r}).hub.commit)\n"
        "try:\n"
        "    resolve_model('org/absent')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
        "print(events, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [MAIN, "ModelLoadError", "[] False"]


def test_a_local_directory_wins_over_a_hub_id(
    hf_home: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny-llama").symlink_to(tiny_model_dir)
    resolved = resolve_model(REPO)
    assert resolved.hub is None
    assert resolved.hf_dir == tmp_path / "org" / "tiny-llama"


def test_a_model_missing_from_the_cache_gets_the_download_command(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = {
        "org/absent": "`hf download org/absent`",
        f"{REPO}@v9": f"`hf download {REPO} --revision v9`",
        f"{REPO}@{'3' * 40}": f"`hf download {REPO} --revision {'3' * 40}`",
    }
    for spec, command in cases.items():
        with pytest.raises(ModelLoadError) as failure:
            resolve_model(spec)
        message = str(failure.value)
        assert "\n" not in message
        assert message.startswith(f"model {spec} is not a local path, nor in the Hugging Face ")
        assert str(hf_home / "hub") in message and "never downloads" in message
        assert message.endswith(command), message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"`HF_HUB_OFFLINE=0 hf download org/absent`$"):
        resolve_model("org/absent")


def test_a_partly_downloaded_snapshot_is_named(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = tmp_path / "staged"
    shutil.copytree(tiny_model_dir, staged)
    (staged / "model.safetensors").rename(staged / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (staged / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    add_to_hub_cache(tmp_path / "hub", REPO, staged, MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(
        ModelLoadError, match=r"lacks model-00002-of-00002\.safetensors.*incomplete"
    ):
        resolve_model(REPO)


def test_a_snapshot_without_weights_says_how_to_fetch_it_again(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `hf download` cut short before the weights: the error named no weights only."""
    staged = tmp_path / "staged"
    shutil.copytree(tiny_model_dir, staged)
    (staged / "model.safetensors").unlink()
    add_to_hub_cache(tmp_path / "hub", REPO, staged, MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights.*cut short") as error:
        resolve_model(REPO)
    assert str(error.value).endswith(f"hf download {REPO}")


def test_a_gguf_repo_points_at_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    snapshot = add_to_hub_cache(tmp_path / "hub", "org/model-GGUF", staged, MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    expected = f"no config.json but GGUF files: .* --model {snapshot / 'model-Q4_K_M.gguf'}"
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model("org/model-GGUF")


def test_run_with_a_model_missing_from_the_cache_is_one_line(
    hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    result = CliRunner().invoke(
        app, ["run", "in.jsonl", "-o", "out.jsonl", "--model", "org/absent"]
    )
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model org/absent"), result.output
    assert lines[0].endswith("`hf download org/absent`")
    assert not (tmp_path / "out.jsonl").exists()


def test_throughput_benchmark_takes_a_hub_id(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import throughput

    argv = ["throughput.py", "--model", REPO, "--num-prompts", "3", "--max-tokens", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1", "--skip-hf"])
    throughput.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("workload: 3 chat prompts")
    assert lines[1].startswith("vbatch (") and "output tok/s" in lines[1]


@pytest.mark.slow
def test_a_job_runs_a_sharded_bf16_model_by_hub_id(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end in real `vbatch` processes: a bf16 checkpoint in two shards, in a hub cache
    of symlinks, named by hub id, writes what the same weights in float32 in one file write;
    then a new snapshot on main stops `vbatch resume`, which names --force."""
    import torch
    from transformers import AutoModelForCausalLM

    float32_dir, bf16_dir = tmp_path / "float32", tmp_path / "bf16"
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    reference.save_pretrained(bf16_dir, max_shard_size="3MB")
    reference.float().save_pretrained(float32_dir)
    for name in os.listdir(tiny_model_dir):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(tiny_model_dir / name, float32_dir / name)
            shutil.copy(tiny_model_dir / name, bf16_dir / name)
    assert len(list(bf16_dir.glob("model-*.safetensors"))) >= 2
    add_to_hub_cache(tmp_path / "hub", REPO, bf16_dir, MAIN)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    rows = [{"id": f"r{i}", "prompt": f"Row {i} says"} for i in range(6)]
    write_jsonl(tmp_path / "in.jsonl", rows)

    def vbatch(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "vbatch", *args, "-q"]
        return subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    run = ["run", "in.jsonl", "--max-tokens", "8", "--ordered", "--num-threads", "1"]
    by_hub_id = vbatch(*run, "-o", "hub.jsonl", "--model", REPO)
    assert by_hub_id.returncode == 0, by_hub_id.stderr
    by_dir = vbatch(*run, "-o", "dir.jsonl", "--model", str(float32_dir))
    assert by_dir.returncode == 0, by_dir.stderr
    hub_rows, dir_rows = read_jsonl(tmp_path / "hub.jsonl"), read_jsonl(tmp_path / "dir.jsonl")
    assert [r["text"] for r in hub_rows] == [r["text"] for r in dir_rows]
    assert all(r["text"] for r in hub_rows)

    manifest = json.loads((job_dir_for(tmp_path / "hub.jsonl") / "manifest.json").read_text())
    assert manifest["model"]["source"] == manifest["model"]["name"] == REPO
    assert manifest["model"]["commit"] == MAIN
    reference.float().save_pretrained(bf16_dir, max_shard_size="3MB")
    add_to_hub_cache(tmp_path / "hub", REPO, bf16_dir, TAGGED)
    refused = vbatch("resume", "hub.jsonl")
    assert refused.returncode != 0
    assert f"now resolves to snapshot {TAGGED}" in refused.stderr and "--force" in refused.stderr
