"""Tiny DeepSeek-V3 and GLM-4-MoE targets saved *with* MTP layers, the way the real checkpoints ship them.

transformers builds neither model's MTP layers and ``save_pretrained`` writes none, so the target is saved first and
random MTP weights (``model.layers.{L+j}.*``: enorm, hnorm, eh_proj, one decoder block in the checkpoint's per-expert
layout, shared_head.norm — and for DeepSeek-V3 the per-layer ``embed_tokens`` / ``shared_head.head`` copies) are
then added to its safetensors file. transformers still loads the target from the folder (it ignores those keys).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, PreTrainedTokenizerFast

from drafter_node.mtp import MTPModule, _modeling_classes
from drafter_node.settings import DrafterConfig
from testkit.tiny_models import save_tiny


def mtp_config(arch: str, vocab_size: int, mtp_layers: int, layers: int = 2):
    common = dict(vocab_size=vocab_size, eos_token_id=0, pad_token_id=1, bos_token_id=None, hidden_size=64,
                  intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  max_position_embeddings=512, num_nextn_predict_layers=mtp_layers, n_group=1, topk_group=1)
    if arch == "deepseek_v3":
        return DeepseekV3Config(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=16, **common)
    if arch == "glm4_moe":
        return Glm4MoeConfig(num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, **common)
    raise ValueError(arch)


def _checkpoint_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors → the per-expert keys real checkpoints store."""
    out = {}
    for name, value in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            for e, w in enumerate(value):
                gate, up = w.chunk(2)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e, w in enumerate(value):
                out[f"{base}.{e}.down_proj.weight"] = w
        else:
            out[name] = value
    return out


def checkpoint_tensors(modules, layers: int) -> dict[str, torch.Tensor]:
    """MTP modules → ``model.layers.{L+j}.*`` tensors in the checkpoint's names and per-expert layout."""
    tensors = {}
    for j, module in enumerate(modules):
        for name, value in _checkpoint_layout(module.state_dict()).items():
            if name.startswith("shared_head_norm."):
                name = "shared_head.norm." + name.removeprefix("shared_head_norm.")
            name = name.removeprefix("block.")
            tensors[f"model.layers.{layers + j}.{name}"] = value.detach().clone().contiguous()
    return tensors


def random_mtp_weights(config, seed: int, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """Random ``model.layers.{L+j}.*`` tensors for every MTP layer of ``config``."""
    torch.manual_seed(seed)
    layer_cls, norm_cls, _ = _modeling_classes(config)
    modules = [MTPModule(config, layer_cls, norm_cls, config.num_hidden_layers + j)
               for j in range(config.num_nextn_predict_layers)]
    with torch.no_grad():
        for module in modules:
            for name, value in module.state_dict().items():
                if name.endswith("norm.weight"):
                    value.fill_(1.0)
                elif name.endswith("e_score_correction_bias"):
                    value.zero_()
                else:
                    value.normal_(0.0, scale)
    return checkpoint_tensors(modules, config.num_hidden_layers)


def mtp_forward(drafter, j: int, prev: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Module j over whole sequences at once, no cache: ``prev`` [B, T, H] hidden rows of positions 0..T−1, ``ids``
    [B, T] the tokens module j reads there (``t[i+j+1]``); returns its output rows [B, T, H]."""
    module = drafter.modules[j]
    x = module.eh_proj(torch.cat([module.enorm(drafter.embed(ids)), module.hnorm(prev)], dim=-1))
    t = ids.shape[1]
    positions = torch.arange(t)[None].expand(ids.shape[0], t)
    mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None].expand(ids.shape[0], 1, t, t)
    rope = drafter.rotary(x, positions)
    return module.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)


def distil_mtp(folder: Path, steps: int = 150, prompts: int = 64, new_tokens: int = 24, seed: int = 0) -> float:
    """Train the MTP layers of the checkpoint in ``folder`` to predict the target's own greedy tokens (so drafts
    are accepted often: full and partial acceptance, pre-draft hits), and write them back. Returns the accuracy of
    module 0 on its training data."""
    from drafter_node.mtp import MTPDrafter

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    prompt = torch.randint(2, vocab, (prompts, 4))
    seqs = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=1)
    with torch.no_grad():
        prev = target(seqs, output_hidden_states=True).hidden_states[-1]
    drafter = MTPDrafter(DrafterConfig(type="mtp", model=str(folder), dtype="float32", device="cpu", q_top_k=0))
    t = seqs.shape[1]
    accuracy = 0.0
    for j, module in enumerate(drafter.modules):
        n = t - j - 2  # positions i with a label t[i+j+2]
        ids, labels = seqs[:, j + 1 : j + 1 + n], seqs[:, j + 2 : j + 2 + n]
        keep = (torch.arange(n) + j + 2 >= prompt.shape[1]).expand(prompts, n)  # labels the target generated
        params = [p for p in module.parameters() if p.is_floating_point()]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=3e-3)
        for _ in range(steps):
            logits = drafter.head(module.shared_head_norm(mtp_forward(drafter, j, prev[:, :n], ids)))
            loss = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out = mtp_forward(drafter, j, prev[:, :n], ids)
            if j == 0:
                accuracy = float((drafter.head(module.shared_head_norm(out)).argmax(-1) == labels)[keep].float().mean())
            prev = out
        for p in params:
            p.requires_grad_(False)
    file = folder / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
        metadata = f.metadata()
    tensors.update(checkpoint_tensors(drafter.modules, target.config.num_hidden_layers))
    save_file(tensors, str(file), metadata=metadata)
    return accuracy


def build_mtp_model(folder: Path, arch: str, tokenizer_folder: Path, seed: int = 1, mtp_layers: int = 1,
                    with_mtp_weights: bool = True, sharpen: float = 1.0, layers: int = 2,
                    distil: bool = False) -> Path:
    """Save a tiny ``arch`` target (DeepSeek-V3 or GLM-4-MoE) and add random MTP layers to its checkpoint."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
    torch.manual_seed(seed)
    config = mtp_config(arch, len(tokenizer), mtp_layers, layers)
    model = AutoModelForCausalLM.from_config(config)
    model.config.tie_word_embeddings = False
    save_tiny(model, tokenizer, folder, sharpen)
    if with_mtp_weights and mtp_layers:
        file = folder / "model.safetensors"
        with safe_open(str(file), "pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
            metadata = f.metadata()
        extra = random_mtp_weights(config, seed + 1000)
        if arch == "deepseek_v3":  # DeepSeek-V3 stores per-MTP-layer copies of the embeddings and the LM head
            for j in range(mtp_layers):
                prefix = f"model.layers.{layers + j}."
                extra[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
                extra[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        save_file({**tensors, **extra}, str(file), metadata=metadata)
        if distil:
            distil_mtp(folder)
    return folder
