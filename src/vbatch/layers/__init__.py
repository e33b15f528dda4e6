"""Model building blocks: paged attention backends, rotary embeddings, norms."""

from __future__ import annotations

import logging

import torch

from vbatch.errors import ConfigError
from vbatch.layers.attention import AttentionBackend, TorchAttentionBackend

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for `name` (auto|torch|native); native falls back to torch when unusable."""
    if name not in ("auto", "torch", "native"):
        raise ConfigError(f"attention backend must be auto, torch or native, got {name!r}")
    if name == "torch":
        return TorchAttentionBackend()
    try:
        from vbatch.layers import native

        if native.is_available():
            return native.NativeAttentionBackend()
        reason = "its kernels are not built for this machine"
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"
    log = logger.warning if name == "native" else logger.info
    log("native attention backend unavailable on %s (%s); using torch", device, reason)
    return TorchAttentionBackend()
