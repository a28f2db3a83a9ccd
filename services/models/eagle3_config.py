"""The Speculators ``config.json`` of an EAGLE-3 / P-EAGLE draft head, read and written.

Speculators (PyPI ``speculators``) saves a draft head as a Hugging Face directory whose
``config.json`` holds ``speculators_model_type`` ("eagle3" or "peagle"), the draft
decoder layer's own config under ``transformer_layer_config`` (a Llama or Qwen3 config),
``draft_vocab_size``, the target layers it reads (``eagle_aux_hidden_state_layer_ids``,
Speculators/vLLM numbering: id ``i`` is the input of target layer ``i``, i.e. the output
of layer ``i - 1``), a few norm flags, and ``speculators_config`` (algorithm, proposal
methods, the verifier it was trained for). This module turns that into one validated
dataclass and back; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.models.checkpoint import CheckpointError

MODEL_TYPES = ("eagle3", "peagle")
LAYER_TYPES = ("llama", "qwen3")  # the draft layer's model_type: qwen3 adds q/k norms
# Flags of the format this implementation does not compute; a head using them is refused.
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm")


class DraftHeadError(CheckpointError):
    """The draft head is malformed, unsupported or does not fit the target model."""


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 (or P-EAGLE) head's architecture, as its ``config.json`` describes it."""

    model_type: str  # "eagle3" or "peagle" (speculators_model_type)
    layer_type: str  # the draft layer's model_type: "llama" or "qwen3"
    hidden_size: int  # the draft layer's width (== its embedding width)
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary (embeddings, d2t's range)
    draft_vocab_size: int  # rows of the draft lm_head
    # Target layers fused by fc, in Speculators numbering (input of layer i); see the
    # module docstring.
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int  # width of one target hidden row (fc's input is len(aux) x it)
    rope: dict = field(default_factory=dict)  # rope_parameters of the draft layer
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_before_residual: bool = False
    # Feed the normed layer output (not the raw one) to the next draft step (EAGLE 3.1).
    norm_output: bool = False
    mask_token_id: int | None = None  # P-EAGLE: the token whose embedding stands in
    verifier: dict = field(default_factory=dict)  # {name_or_path, architectures}
    speculative_tokens: int = 5  # the greedy proposal method's default k

    @property
    def parallel(self) -> bool:
        """A P-EAGLE head (it carries a learned mask hidden state)."""
        return self.model_type == "peagle"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose *outputs* the head reads (0-based): id - 1."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise DraftHeadError(
                f"speculators_model_type {self.model_type!r} is not one of {MODEL_TYPES}"
            )
        if self.layer_type not in LAYER_TYPES:
            raise DraftHeadError(
                f"draft layer model_type {self.layer_type!r} unsupported; supported: {LAYER_TYPES}"
            )
        if not self.aux_layer_ids or min(self.aux_layer_ids) < 1:
            raise DraftHeadError(
                f"eagle_aux_hidden_state_layer_ids must be >= 1 (layer 0 is the embeddings), "
                f"got {list(self.aux_layer_ids)}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DraftHeadError(
                f"draft_vocab_size {self.draft_vocab_size} not in [1, vocab_size={self.vocab_size}]"
            )
        if self.num_heads % self.num_kv_heads:
            raise DraftHeadError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.parallel and self.mask_token_id is None:
            raise DraftHeadError("a peagle head needs mask_token_id")

    def check_target(self, target) -> None:
        """Raise a clear error unless this head fits the target's (transformers) config."""
        text = getattr(target, "text_config", None) or target
        errors = []
        if text.hidden_size != self.target_hidden_size:
            errors.append(
                f"hidden size: head expects {self.target_hidden_size}, target has {text.hidden_size}"
            )
        if text.vocab_size != self.vocab_size:
            errors.append(
                f"vocab size: head maps to {self.vocab_size}, target has {text.vocab_size}"
            )
        n = text.num_hidden_layers
        if max(self.aux_layer_ids) > n:
            errors.append(f"aux layer ids {list(self.aux_layer_ids)}: the target has {n} layers")
        if errors:
            raise DraftHeadError("draft head does not fit the target model: " + "; ".join(errors))

    @classmethod
    def from_json(cls, cfg: dict) -> Eagle3Config:
        """Parse a Speculators ``config.json`` dict (defaults as Speculators has them)."""
        kind = cfg.get("speculators_model_type")
        if kind is None:
            raise DraftHeadError(
                "config.json has no speculators_model_type: not a Speculators head"
            )
        for flag in _UNSUPPORTED_FLAGS:
            if cfg.get(flag):
                raise DraftHeadError(f"head flag {flag}=true is not supported")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise DraftHeadError("config.json has no transformer_layer_config")
        if layer.get("num_hidden_layers", 1) != 1:
            raise DraftHeadError("only one-layer draft heads are supported")
        hidden = _req(layer, "hidden_size")
        heads = _req(layer, "num_attention_heads")
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        return cls(
            model_type=kind,
            layer_type=layer.get("model_type", "qwen3"),  # Speculators' default layer
            hidden_size=hidden,
            intermediate_size=_req(layer, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            vocab_size=_req(layer, "vocab_size"),
            draft_vocab_size=cfg.get("draft_vocab_size", 32000),
            aux_layer_ids=tuple(_req(cfg, "eagle_aux_hidden_state_layer_ids")),
            target_hidden_size=cfg.get("target_hidden_size") or hidden,
            rope=_rope(layer),
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            norm_output=bool(cfg.get("norm_output", False)),
            mask_token_id=cfg.get("mask_token_id"),
            verifier=dict(spec.get("verifier") or {}),
            speculative_tokens=int(methods[0].get("speculative_tokens", 5)),
        )

    def to_json(self) -> dict:
        """The Speculators ``config.json`` for this head (what ``from_json`` reads back)."""
        arch = "PEagleSpeculator" if self.parallel else "Eagle3Speculator"
        out = {
            "architectures": [arch],
            "speculators_model_type": self.model_type,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_output": self.norm_output,
            "norm_before_fc": False,
            "fc_norm": False,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "transformer_layer_config": self._layer_json(),
            "speculators_config": {
                "algorithm": self.model_type,
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": self.verifier.get("name_or_path"),
                    "architectures": list(self.verifier.get("architectures", [])),
                },
            },
        }
        if self.parallel:
            out["mask_token_id"] = self.mask_token_id
        return out

    def _layer_json(self) -> dict:
        return {
            "model_type": self.layer_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "rope_parameters": dict(self.rope),
        }


def _req(d: dict, key: str):
    if key not in d:
        raise DraftHeadError(f"draft head config.json lacks {key!r}")
    return d[key]


def _rope(layer: dict) -> dict:
    """rope_parameters in the transformers >= 5 shape, from either spelling."""
    params = layer.get("rope_parameters")
    if params:
        return dict(params)
    params = dict(layer.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", layer.get("rope_theta", 10000.0))
    return params
