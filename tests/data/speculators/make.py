"""Regenerate tests/data/speculators/ with the real Speculators library (PyPI speculators 0.9.0).

Run it in a throwaway venv that has speculators (never the project venv):
    python tests/data/speculators/make.py tests/data/speculators
It writes a tiny random EAGLE-3 and P-EAGLE head with speculators' own save_pretrained and,
for each, the logits speculators computes at TTT step 0 over fixed inputs
(<kind>_reference.safetensors); tests/unit/test_eagle3_head.py checks ours against them.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators.models.peagle.core import PEagleDraftModel
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

V, VD, H, T = 96, 48, 32, 12


def layer_config() -> LlamaConfig:
    c = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    c._attn_implementation = "eager"  # flex attention needs a GPU compiler
    return c


def build(kind: str, cfg_cls, model_cls, out: Path) -> None:
    extra = {"mask_token_id": 5} if kind == "peagle" else {}
    spec = SpeculatorsConfig(
        algorithm=kind,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    cfg = cfg_cls(
        transformer_layer_config=layer_config(),
        draft_vocab_size=VD,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=spec,
        **extra,
    )
    m = model_cls(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            unit = 1.0 if p.dim() == 1 and "norm" in n else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.1) + unit)
        m.d2t.copy_(torch.randperm(V, generator=g)[:VD].sort().values - torch.arange(VD))
        m.t2d.zero_()
        m.t2d[torch.arange(VD) + m.d2t] = True
    m.eval()
    hidden = torch.randn(1, T, 3 * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    logits = []
    hook = m.lm_head.register_forward_hook(lambda mod, i, o: logits.append(o.detach().clone()))
    with torch.no_grad():  # Eagle3's inference path (P-EAGLE's forward is training-only)
        Eagle3DraftModel.forward(
            m,
            hidden_states=hidden,
            input_ids=ids,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=1,
        )
    hook.remove()
    m.save_pretrained(str(out / kind))
    (out / kind / "config.py").unlink(missing_ok=True)  # speculators' own source, not ours to ship
    ref = {"hidden": hidden[0], "input_ids": ids[0], "logits": logits[0][0]}
    save_file(
        {k: v.contiguous() for k, v in ref.items()}, str(out / f"{kind}_reference.safetensors")
    )


if __name__ == "__main__":
    root = Path(sys.argv[1])
    build("eagle3", Eagle3SpeculatorConfig, Eagle3DraftModel, root)
    build("peagle", PEagleSpeculatorConfig, PEagleDraftModel, root)
