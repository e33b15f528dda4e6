"""ModelConfig: the architecture facts vbatch needs, read from an HF config.json.

The fields common to every family are read here; what a family adds to the Llama decoder (q/k
norms, Gemma's norms and soft caps, sliding windows, experts, ...) comes from its reader in
models/families.py, which also defines the supported architectures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vbatch.errors import ModelLoadError
from vbatch.models import families, hf_defaults

SUPPORTED_ARCHITECTURES = families.SUPPORTED_ARCHITECTURES
# NOTE: transformers' text-only class prefixes whose causal LM goes by the family's own name.
TEXT_ONLY_FAMILIES = {"Gemma3Text": "Gemma3"}
# NOTE: a config.json's model_type (transformers' names) to its causal LM, for a config that
# names no architectures.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_ROPE_TYPES = families.SUPPORTED_ROPE_TYPES
# NOTE: encoder-only models run by models/bert.py (XLM-RoBERTa and RoBERTa are BERT with
# positions counted from the padding id + 1).
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")


def read_id2label(path: str | Path) -> dict[int, str]:
    """A classifier's label names from its config.json (empty without them)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
        return {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def read_problem_type(path: str | Path) -> str | None:
    """A classifier's `problem_type` from its config.json (regression, single- or multi-label
    classification; None without it), which decides its scores' activation."""
    try:
        value = json.loads((Path(path) / "config.json").read_text()).get("problem_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SentenceBertConfig:
    """A checkpoint's `sentence_bert_config.json`: the longest prompt sentence-transformers
    embeds (None: the model's), and whether it lowercases the text first."""

    max_seq_length: int | None = None
    do_lower_case: bool = False


def read_sentence_bert_config(hf_dir: str | Path) -> SentenceBertConfig:
    path = Path(hf_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return SentenceBertConfig()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    length = raw.get("max_seq_length")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 1
    ):
        raise ModelLoadError(f"{path}: max_seq_length must be a positive integer, got {length!r}")
    lower = raw.get("do_lower_case", False)
    if not isinstance(lower, bool):
        raise ModelLoadError(f"{path}: do_lower_case must be true or false, got {lower!r}")
    return SentenceBertConfig(length, lower)


def is_encoder_dir(path: str | Path) -> bool:
    """Whether the model in `path` is an encoder-only one (by its config.json)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    try:
        return any(a in ENCODER_ARCHITECTURES for a in architecture_names(raw))
    except ModelLoadError:
        return False


def architecture_names(raw: dict[str, Any]) -> list[str]:
    """config.json's `architectures`: a list of class names (one name alone taken as a list of
    one); ModelLoadError for any other value."""
    value = raw.get("architectures") or []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ModelLoadError(f"architectures must be a list of class names, not {value!r}")
    return value


def json_object(text: str, path: Path) -> dict[str, Any]:
    """The JSON object `text` (the contents of `path`); ModelLoadError for anything else."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder and the family hooks it takes.

    Invariants: num_attention_heads % num_key_value_heads == 0; head_dim and rotary_dim are
    even, rotary_dim <= head_dim; rope_scaling (and sliding_rope_scaling) is None or has a
    rope_type in SUPPORTED_ROPE_TYPES; sliding_windows, sliding_rope_layers and moe_layers have
    one entry per layer (or none).
    Every hook's default is the plain Llama behaviour.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # on the q, k and v projections
    mlp_bias: bool  # on the gate, up and down projections (Llama)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # --- family hooks ---
    o_proj_bias: bool = False
    hidden_act: str = "silu"  # of the gated MLP: silu, or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    norm_weight_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2/3)
    embedding_multiplier: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    rotary_dim: int = 0  # the leading dims of each head that rotate (all but with Phi-4-mini)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () means none anywhere
    # Rope base and scaling of the sliding-window layers where they differ (Gemma 3), and which
    # layers those are (per layer, whether or not their window binds).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    sliding_rope_layers: tuple[bool, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE): top-k of num_experts per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[bool, ...] = field(default=())  # per layer; () means no MoE layer
    # What follows the final norm: the LM head ("lm"), a classifier's `score` linear to
    # num_labels ("score", *ForSequenceClassification), or nothing ("none", the bare *Model).
    head: str = "lm"
    num_labels: int = 0
    # NOTE: a classifier scores the last token that is not this one, as transformers does.
    pad_token_id: int | None = None

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar or self.head_dim
        return float(base) ** -0.5

    def sliding_window(self, layer: int) -> int | None:
        """The window of layer `layer`'s attention, None for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def long_rope_from(self) -> int | None:
        """With longrope, the pre-training length: a longer sequence rotates every position by
        the long factors, so its K/V are recomputed once it grows past it; else None, as with
        long factors equal to the short ones (a converted llama.cpp `rope_freqs`), where no
        length changes a rotation."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return None
        if scaling["long_factor"] == scaling["short_factor"]:
            return None
        return int(scaling["original_max_position_embeddings"])

    def uses_sliding_rope(self, layer: int) -> bool:
        return self.sliding_rope_theta is not None and bool(
            self.sliding_rope_layers and self.sliding_rope_layers[layer]
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_path = path / "config.json"
        try:
            raw = json_object(config_path.read_text(), config_path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read model config {config_path}: {e}") from e
        generation: dict[str, Any] = {}
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            try:
                generation = json_object(generation_path.read_text(), generation_path)
            except ValueError as e:
                raise ModelLoadError(f"cannot parse {generation_path}: {e}") from e
        try:
            return cls.from_dict(raw, generation)
        except ModelLoadError as e:
            raise ModelLoadError(f"model config {config_path}: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"model config {config_path} is invalid: {e!r}") from e

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architectures = architecture_names(raw)
        if not architectures and raw.get("model_type") in MODEL_TYPES:
            # NOTE: as transformers' Auto classes: the model type names the causal LM.
            architectures = [MODEL_TYPES[raw["model_type"]]]
        architecture, head = next(
            (found for a in architectures if (found := _decoder_architecture(a)) is not None),
            (None, "lm"),
        )
        if architecture is None:
            raise ModelLoadError(
                f"unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        raw = hf_defaults.with_defaults(architecture, raw)
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads < 1 or num_kv_heads < 1:
            raise ModelLoadError(f"bad attention shape: {num_heads} heads, {num_kv_heads} kv heads")
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads or head_dim % 2:
            raise ModelLoadError(
                f"bad attention shape: {num_heads} heads, {num_kv_heads} kv heads, "
                f"head_dim {head_dim}"
            )
        base: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw["rms_norm_eps"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw["tie_word_embeddings"]),
            attention_bias=bool(raw["attention_bias"]),
            mlp_bias=bool(raw["mlp_bias"]),
            bos_token_id=(
                raw["bos_token_id"]
                if raw["bos_token_id"] is not None
                else (generation or {}).get("bos_token_id")
            ),
            eos_token_ids=_eos_token_ids(raw, generation or {}),
            head=head,
            num_labels=_num_labels(raw) if head == "score" else 0,
            pad_token_id=_pad_token_id(raw) if head == "score" else None,
        )
        # NOTE: the family reader sees the common fields and returns what it adds or overrides,
        # rope included (its parameters live in family-specific places).
        hooks = families.read_family(architecture, raw, base)
        config = cls(**{**base, **hooks})
        config._check()
        return config

    def _check(self) -> None:
        # NOTE: `not x > 0` also refuses NaN; a rope base or norm epsilon out of range ran,
        # giving NaN logits and empty texts without an error.
        for name in ("rope_theta", "sliding_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ModelLoadError(f"{name} must be a positive number, got {value}")
        if not (self.rms_norm_eps >= 0 and math.isfinite(self.rms_norm_eps)):
            raise ModelLoadError(f"rms_norm_eps must be zero or positive, got {self.rms_norm_eps}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_position_embeddings < 1:
            raise ModelLoadError(
                f"max_position_embeddings must be positive, got {self.max_position_embeddings}"
            )
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ModelLoadError(f"bad rotary_dim {self.rotary_dim} for head_dim {self.head_dim}")
        for name in ("sliding_windows", "sliding_rope_layers", "moe_layers"):
            value = getattr(self, name)
            if value and len(value) != self.num_hidden_layers:
                raise ModelLoadError(
                    f"{name} has {len(value)} entries for {self.num_hidden_layers} layers"
                )
        if any(window is not None and window < 1 for window in self.sliding_windows):
            raise ModelLoadError(f"bad sliding window in {self.sliding_windows}")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"bad experts: top {self.num_experts_per_tok} of {self.num_experts}"
            )


def _pad_token_id(raw: dict[str, Any]) -> int | None:
    value = raw.get("pad_token_id")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# NOTE: ModelConfig.head's values, as messages name them.
HEAD_NAMES = {"lm": "an LM head", "score": "a classifier head", "none": "no head"}


def declared_head(model_path: Path) -> str:
    """The head (ModelConfig.head) a model declares, read from its files alone: a GGUF file's is
    "lm"; an HF directory's by its config.json architectures, "none" for a model that is no
    supported decoder (an encoder). An unreadable config says "lm": loading it reports why."""
    if not model_path.is_dir():
        return "lm"
    try:
        raw = json.loads((model_path / "config.json").read_text())
        names = architecture_names(raw)
        if not names and raw.get("model_type") in MODEL_TYPES:
            names = [MODEL_TYPES[raw["model_type"]]]
    except (OSError, ValueError, AttributeError, TypeError, ModelLoadError):
        return "lm"
    for name in names:
        found = _decoder_architecture(name)
        if found is not None:
            return found[1]
    return "none"


def _decoder_architecture(name: str) -> tuple[str, str] | None:
    """(the supported causal-LM architecture, head) that `name` is: `XForCausalLM` itself,
    `XForSequenceClassification` with a score head, the bare `XModel` with none; Gemma 3's
    text-only classes (`Gemma3TextForSequenceClassification`) are Gemma3ForCausalLM's."""
    for suffix, head in (
        ("ForCausalLM", "lm"),
        ("ForSequenceClassification", "score"),
        ("Model", "none"),
    ):
        if name.endswith(suffix):
            family = name.removesuffix(suffix)
            causal = TEXT_ONLY_FAMILIES.get(family, family) + "ForCausalLM"
            return (causal, head) if causal in SUPPORTED_ARCHITECTURES else None
    return None


def _num_labels(raw: dict[str, Any]) -> int:
    if "num_labels" in raw:
        return int(raw["num_labels"])
    return len(raw.get("id2label") or {}) or 2


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    eos_ids: list[int] = []
    for source, value in (
        ("generation_config.json", generation.get("eos_token_id")),
        ("config.json", raw.get("eos_token_id")),
    ):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is None:
                continue
            try:
                eos_id = int(token_id)
            except (TypeError, ValueError):
                raise ModelLoadError(
                    f"{source}: eos_token_id {value!r:.60} is not a token id or a list of them"
                ) from None
            if eos_id not in eos_ids:
                eos_ids.append(eos_id)
    return tuple(eos_ids)
