"""``mtp`` drafter: the multi-token-prediction layers shipped inside the target checkpoint (DeepSeek-V3, GLM-4.5;
``num_nextn_predict_layers`` = K), fed with the target's own last hidden states.

MTP module j (the checkpoint's ``model.layers.{L+j}.*``, L = ``num_hidden_layers``) combines the hidden state of
position i — the target's final-norm hidden state for j = 0, module j−1's output for deeper ones — with the
embedding of token ``t[i+j+1]``::

    x = eh_proj(cat[enorm(embed(t[i+j+1])), hnorm(h[i])])      # the order vLLM and SGLang use
    h'[i] = block(x)                                            # the target's decoder-layer class, own KV cache
    logits for t[i+j+2] = lm_head(shared_head.norm(h'[i]))

The drafter loads only those layers, the embeddings and the LM head, reading just their tensors from the
safetensors files (a fraction of the target's memory). transformers' DeepseekV3/Glm4Moe models do not build the MTP
layers, so each module is assembled here from the target's own decoder-layer class (with ``layer_idx = L + j``, so
its attention and MoE shapes are the checkpoint's) plus two RMSNorms, a Linear and the shared-head norm.

Hidden states: the verifier sends the target's final-norm hidden states of every newly committed position — at
session start those of ``prompt[:-1]``, with each commit those of ``[pending, accepted drafts]`` — so after any
commit the drafter holds the rows of positions ``0 .. n−2`` (n committed tokens; the last one is pending and has
none yet). With them, module j at position n−2 drafts token n+j: K drafts per round (``block_len = K``), and
``propose`` returns 0 beyond them until the next commit brings new rows.

Every module keeps a KV cache and its output rows over positions; both are incremental across rounds. Module j's
entry at position i depends on the tokens up to ``t[i+j+1]`` (some of which are drafts), so a rollback to a
sequence length ``m`` keeps exactly the positions ``i < m − j − 1`` of module j.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from transformers import AutoConfig

from drafter_node.base import Capabilities, Drafter, DraftSession
from drafter_node.lm_drafter import pick_token
from drafter_node.settings import DrafterConfig
from shared.checkpoint import read_tensors, weight_map
from shared.models import DTYPES, ProfileSpec, concrete_dtype, load_tokenizer, resolve_model, tokenizer_id
from shared.sampling import GenerationParams


class MTPError(ValueError):
    """The target checkpoint has no usable MTP layers."""


def mtp_layer_count(config) -> int:
    value = getattr(config, "num_nextn_predict_layers", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name → the safetensors file holding it; :class:`MTPError` when the checkpoint has no safetensors."""
    files = weight_map(path)
    if files is None:
        raise MTPError(f"drafter.type mtp: {path!r} has no safetensors weights (model.safetensors or an index)")
    return files


def check_mtp_checkpoint(folder: str, config=None, files: dict[str, str] | None = None) -> int:
    """The number of MTP layers K of the checkpoint in ``folder``; raises :class:`MTPError` when it has none."""
    config = config or AutoConfig.from_pretrained(folder)
    k = mtp_layer_count(config)
    model_type = getattr(config, "model_type", "?")
    if k < 1:
        raise MTPError(
            f"drafter.type mtp: the target {folder!r} ({model_type}) has no MTP layers "
            f"(num_nextn_predict_layers = {getattr(config, 'num_nextn_predict_layers', None)!r} in its config.json); "
            "use a checkpoint that ships them (DeepSeek-V3, GLM-4.5) or another drafter type"
        )
    layers = config.num_hidden_layers
    keys = files if files is not None else checkpoint_files(folder)
    missing = [f"model.layers.{layers + j}.eh_proj.weight" for j in range(k)
               if f"model.layers.{layers + j}.eh_proj.weight" not in keys]
    if missing:
        raise MTPError(
            f"drafter.type mtp: the target {folder!r} declares num_nextn_predict_layers = {k} but its weights lack "
            f"the MTP layers ({', '.join(missing)} not found); a checkpoint re-saved by transformers drops them — "
            "use the original checkpoint or another drafter type"
        )
    return k


def _modeling_classes(config):
    """The target architecture's decoder-layer, RMSNorm and rotary-embedding classes."""
    from transformers import AutoModelForCausalLM

    model_cls = AutoModelForCausalLM._model_mapping[type(config)]
    module = importlib.import_module(model_cls.__module__)
    names = list(getattr(model_cls, "_no_split_modules", None) or [])
    layer_name = next((n for n in names if n.endswith("DecoderLayer")), None)
    if layer_name is None:
        raise MTPError(f"drafter.type mtp: cannot find the decoder-layer class of {model_cls.__name__}")
    prefix = layer_name.removesuffix("DecoderLayer")
    return getattr(module, layer_name), getattr(module, f"{prefix}RMSNorm"), getattr(module, f"{prefix}RotaryEmbedding")


class MTPModule(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj, one decoder block and the shared-head norm."""

    def __init__(self, config, layer_cls, norm_cls, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.enorm = norm_cls(h, eps=config.rms_norm_eps)
        self.hnorm = norm_cls(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = layer_cls(config, layer_idx=layer_idx)
        self.block.self_attn.layer_idx = 0  # each module has a one-layer cache of its own
        self.shared_head_norm = norm_cls(h, eps=config.rms_norm_eps)


def _fuse_experts(state: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj.weight`` …) → transformers' fused
    ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` where the module wants those."""
    out = dict(state)
    for target in wanted:
        if target in out or not target.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        base = target.rsplit(".", 1)[0]  # "mlp.experts"
        count = 0
        while f"{base}.{count}.down_proj.weight" in out:
            count += 1
        if count == 0:
            continue
        if target.endswith("gate_up_proj"):
            out[target] = torch.stack([
                torch.cat([out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"]])
                for e in range(count)
            ])
        else:
            out[target] = torch.stack([out[f"{base}.{e}.down_proj.weight"] for e in range(count)])
    for key in [k for k in out if k not in wanted and ".experts." in k and k.split(".experts.")[1][:1].isdigit()]:
        del out[key]
    return out


def load_mtp(path: str, dtype: torch.dtype, device: str):
    """Build the K MTP modules, embeddings and LM head of the checkpoint in ``path`` and read only their tensors."""
    config = AutoConfig.from_pretrained(path)
    files = checkpoint_files(path)
    k = check_mtp_checkpoint(path, config, files)
    if getattr(config, "_attn_implementation", None) in (None, "flash_attention_2", "flex_attention"):
        config._attn_implementation = "sdpa"
    if getattr(config, "_experts_implementation", None) is None:
        config._experts_implementation = "eager"  # the experts' plain loop (a standalone module gets no dispatch)
    layer_cls, norm_cls, rotary_cls = _modeling_classes(config)
    layers = config.num_hidden_layers

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        return read_tensors(path, files, keys)

    def first(*keys: str) -> str:
        for key in keys:
            if key in files:
                return key
        raise MTPError(f"drafter.type mtp: {path!r} has none of {', '.join(keys)}")

    modules = []
    for j in range(k):
        prefix = f"model.layers.{layers + j}."
        # DeepSeek-V3 also stores per-layer copies of the embeddings and LM head: the shared ones are read once.
        copies = (prefix + "embed_tokens.", prefix + "shared_head.head.")
        raw = read([key for key in files if key.startswith(prefix) and not key.startswith(copies)])
        state = {}
        for key, value in raw.items():
            name = key[len(prefix):]
            if name.startswith("shared_head.norm."):
                name = "shared_head_norm." + name[len("shared_head.norm."):]
            elif not name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                name = "block." + name
            state[name] = value
        with torch.device("meta"):
            module = MTPModule(config, layer_cls, norm_cls, layers + j)
        wanted = set(module.state_dict())
        state = _fuse_experts(state, wanted)
        try:
            module.load_state_dict({n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()},
                                   strict=True, assign=True)
        except RuntimeError as exc:
            raise MTPError(f"drafter.type mtp: MTP layer {layers + j} of {path!r} does not fit "
                           f"{layer_cls.__name__}: {exc}") from None
        unset = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if unset:
            raise MTPError(f"drafter.type mtp: MTP layer {layers + j} of {path!r} leaves {', '.join(unset)} unset")
        modules.append(module.to(device).eval())
    embed_key = first("model.embed_tokens.weight", f"model.layers.{layers}.embed_tokens.weight")
    head_keys = ["lm_head.weight", f"model.layers.{layers}.shared_head.head.weight"]
    if getattr(config, "tie_word_embeddings", False):
        head_keys.append(embed_key)
    head_key = first(*head_keys)
    tensors = read(sorted({embed_key, head_key}))
    embed = nn.Embedding.from_pretrained(tensors[embed_key].to(dtype), freeze=True).to(device)
    head = nn.Linear(config.hidden_size, tensors[head_key].shape[0], bias=False)
    head.weight = nn.Parameter(tensors[head_key].to(dtype), requires_grad=False)
    rotary = rotary_cls(config=config).to(device)
    return config, nn.ModuleList(modules), embed, head.to(device), rotary


class Rows:
    """Per-position row vectors for absolute positions ``start .. end − 1``."""

    def __init__(self, start: int, data: torch.Tensor):
        self.start = start
        self.data = data

    @property
    def end(self) -> int:
        return self.start + self.data.shape[0]

    def get(self, a: int, b: int) -> torch.Tensor:
        return self.data[a - self.start : b - self.start]

    def append(self, rows: torch.Tensor) -> None:
        self.data = torch.cat([self.data, rows.to(self.data)])

    def truncate(self, end: int) -> None:
        self.data = self.data[: max(0, end - self.start)]

    def drop_before(self, pos: int) -> None:
        if pos > self.start:
            self.data = self.data[pos - self.start :]
            self.start = pos


class MTPDrafter(Drafter):
    type_name = "mtp"

    def __init__(self, settings: DrafterConfig, own: None = None,
                 profile: ProfileSpec | None = None):  # no causal LM: no profile
        path = resolve_model(settings.model)
        self.tokenizer = load_tokenizer(path)
        self.tokenizer_id = tokenizer_id(self.tokenizer)
        self.dtype = DTYPES[concrete_dtype(settings.dtype, settings.device)]
        self.device = settings.device
        if self.device == "auto":  # a few layers: one device is enough
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.config, self.modules, self.embed, self.head, self.rotary = load_mtp(path, self.dtype, self.device)
        self.block_len = len(self.modules)
        self.q_top_m = settings.q_top_k
        self.capabilities = Capabilities(sends_q=True, greedy_q=True, needs_hidden_states=True)
        self.target_vocab_size = self.config.vocab_size  # replaced by the verifier's at connect time

    def parameters(self):
        for part in (self.modules, self.embed, self.head):
            yield from part.parameters()

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> MTPDraftSession:
        return MTPDraftSession(self, token_ids, prompt_len, params, (extras or {}).get("hidden"))


class MTPDraftSession(DraftSession):
    def __init__(self, drafter: MTPDrafter, token_ids: list[int], prompt_len: int, params: GenerationParams,
                 hidden: torch.Tensor | None):
        super().__init__(token_ids, prompt_len, params)
        self.d = drafter
        self._reset(0, hidden)

    # ------------------------------------------------------------------ state
    def _reset(self, start: int, hidden: torch.Tensor | None) -> None:
        """Forget everything; the target's hidden rows (re)start at position ``start``."""
        from transformers import DynamicCache

        start = max(start, 0)
        empty = torch.empty(0, self.d.config.hidden_size, dtype=self.d.dtype, device=self.d.device)
        if hidden is not None and hidden.shape[0] == len(self.committed) - 1 - start:
            self.target_rows = Rows(start, hidden.to(device=self.d.device, dtype=self.d.dtype))
        else:  # no (or unusable) rows: draft again once commits bring rows from the pending position on
            start = len(self.committed) - 1
            self.target_rows = Rows(start, empty)
        self.start = start
        self.caches = [DynamicCache() for _ in self.d.modules]
        self.lengths = [start] * len(self.d.modules)  # module j holds positions start .. lengths[j] − 1
        self.outs = [Rows(start, empty.clone()) for _ in self.d.modules]

    @property
    def rows_end(self) -> int:
        """Positions below this have a target hidden row (normally len(committed) − 1)."""
        return self.target_rows.end

    def _run(self, j: int, upto: int) -> None:
        """Extend module j's cache and output rows over positions up to ``upto`` (inclusive)."""
        a = self.lengths[j]
        if a > upto:
            return
        if j == 0:
            prev = self.target_rows.get(a, upto + 1)
        else:
            self._run(j - 1, upto)
            prev = self.outs[j - 1].get(a, upto + 1)
        seq = self.committed + self.chain_tokens
        ids = torch.tensor(seq[a + j + 1 : upto + j + 2], dtype=torch.long, device=self.d.device)
        module = self.d.modules[j]
        with torch.inference_mode():
            x = module.eh_proj(torch.cat([module.enorm(self.d.embed(ids)), module.hnorm(prev)], dim=-1))[None]
            positions = torch.arange(a, upto + 1, device=self.d.device)[None]
            keys = torch.arange(self.start, upto + 1, device=self.d.device)
            mask = torch.zeros(1, 1, positions.shape[1], keys.numel(), dtype=x.dtype, device=self.d.device)
            mask.masked_fill_(keys[None, :] > positions[0][:, None], torch.finfo(x.dtype).min)
            out = module.block(x, attention_mask=mask, position_ids=positions, cache=self.caches[j], use_cache=True,
                               position_embeddings=self.d.rotary(x, positions))
        self.outs[j].append(out[0])
        self.lengths[j] = upto + 1

    def draft_logits(self) -> torch.Tensor | None:
        """Raw float32 logits for the next chain token, or None when no MTP module reaches it."""
        p = self.rows_end - 1  # the newest position with a target hidden state
        j = len(self.committed) + len(self.chain) - p - 2  # module j at position p predicts token p + j + 2
        if p < self.start or not 0 <= j < len(self.d.modules):
            return None
        self._run(j, p)
        module = self.d.modules[j]
        with torch.inference_mode():
            return self.d.head(module.shared_head_norm(self.outs[j].get(p, p + 1)))[0].float()

    # ------------------------------------------------------------------ DraftSession
    def propose(self, n: int) -> int:
        added = 0
        while added < n and not self.ended:
            logits = self.draft_logits()
            if logits is None:
                break  # the next token needs target hidden states the verifier has not sent yet
            ids = self.committed + self.chain_tokens
            self.chain.append(pick_token(logits, ids, self.params, self.prompt_len, self.d.target_vocab_size,
                                         self.d.q_top_m, self.want_q))
            added += 1
        return added

    def _truncate(self, length: int) -> None:
        for j, cache in enumerate(self.caches):
            keep = max(self.start, min(self.lengths[j], length - j - 1))
            if keep < self.lengths[j]:
                cache.crop(keep - self.lengths[j])
                self.outs[j].truncate(keep)
                self.lengths[j] = keep

    def observe_commit(self, tokens: list[int], extras: dict[str, torch.Tensor] | None = None) -> int:
        base_len = len(self.committed)
        matched = super().observe_commit(tokens, extras)
        hidden = (extras or {}).get("hidden")
        if hidden is not None and hidden.shape[0] == len(tokens) and self.rows_end == base_len - 1:
            self.target_rows.append(hidden.to(device=self.d.device, dtype=self.d.dtype))
            self._forget_consumed()
        else:
            self.chain = []
            self._reset(len(self.committed) - 1, None)
        return matched

    def _forget_consumed(self) -> None:
        """Drop rows no module can need again (module 0 never rolls back; module j+1 never below n − j − 3)."""
        self.target_rows.drop_before(self.lengths[0])
        n = len(self.committed)
        for j in range(len(self.outs) - 1):
            self.outs[j].drop_before(min(self.lengths[j + 1], n - j - 3))
        if self.outs:
            self.outs[-1].drop_before(self.lengths[-1] - 1)
