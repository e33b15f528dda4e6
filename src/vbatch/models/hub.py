"""Hub ids (`org/name`, `org/name@revision`) in the local Hugging Face cache, never fetched."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from vbatch.errors import ModelLoadError

# NOTE: hub names start with a letter or digit; this keeps `./x`, `../x` and `~/x` paths out.
_HUB_ID = re.compile(r"^([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(\S+))?$")
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubSnapshot:
    """`repo_id` at `revision` (None: the default branch) as the cache holds it: the snapshot
    directory `path` of commit `commit`."""

    repo_id: str
    revision: str | None
    commit: str
    path: Path

    @property
    def spec(self) -> str:
        """The model as the user named it, `org/name` or `org/name@revision`."""
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` reads as a hub id; None when it cannot be one."""
    match = _HUB_ID.match(spec)
    if match is None or match.group(1).lower().endswith(".gguf"):
        return None
    return match.group(1), match.group(2)


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub. Read at each call, so a change
    of the environment after import counts."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(os.path.expandvars(cache)).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def download_command(repo_id: str, revision: str | None) -> str:
    """The shell command that fetches the model into the cache vbatch reads."""
    command = f"hf download {shlex.quote(repo_id)}"
    if revision is not None:
        command += f" --revision {shlex.quote(revision)}"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        command = f"HF_HUB_OFFLINE=0 {command}"
    return command


def find_snapshot(repo_id: str, revision: str | None) -> HubSnapshot:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit), through
    huggingface_hub with local files only: refs/<revision> names the commit, snapshots/<commit>
    holds the files. Raises ModelLoadError with the `hf download` command when it is absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    spec = repo_id if revision is None else f"{repo_id}@{revision}"
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True
        )
    except HFValidationError as e:
        raise ModelLoadError(
            f"model {spec} is not a local path, nor a valid Hugging Face repo id ({e})"
        ) from None
    except LocalEntryNotFoundError as e:
        fetch = download_command(repo_id, revision)
        if getattr(e, "snapshot_path", None) is not None:
            raise ModelLoadError(
                f"model {spec} is only partly downloaded in the Hugging Face cache ({cache}); "
                f"complete it with `{fetch}`"
            ) from None
        raise ModelLoadError(
            f"model {spec} is not a local path, nor in the Hugging Face cache ({cache}); "
            f"vbatch never downloads: fetch it with `{fetch}`"
        ) from None
    path = Path(folder)
    return HubSnapshot(repo_id, revision, path.name, path)
