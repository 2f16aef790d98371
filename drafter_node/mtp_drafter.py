"""``mtp_drafter``: a separate drafter checkpoint that reads the target's state (Gemma 4 ``-assistant``,
``Gemma4AssistantForCausalLM``).

The assistant has no K/V projections of its own: each of its layers attends, by layer type (full / sliding), to the
K/V of the target layer that *stores* that type (``Gemma4TextConfig.kv_sharing_modes``: the last non-shared layer
of each type). Its input at a step is ``[target_embedding(token), hidden]``: the target's own (scaled) input
embedding of the last token, next to the target's last hidden state at the position before it; the assistant
returns logits and a projected hidden state that it feeds back for the next step, at a constant position
(transformers' ``SinglePositionMultiTokenCandidateGenerator``).

What this drafter holds: the assistant checkpoint and the target's input embedding table (read alone from the
target's safetensors; no target layer is loaded). What it needs from the verifier: the target's last hidden states
and the new K/V rows of the needed layers for the committed positions (``session_start`` after prefill, then every
``commit``). The rows always cover the committed positions but the pending last token, the same positions as the
verifier's cache, so the drafter's copy never holds a row of an uncommitted token: a rejection changes nothing in
it (the verifier sends rows only after its own rollback), and the drafter re-anchors its next block on the fresh
hidden state. Unlike transformers 5.24 (argmax drafts, raw logits as q), tokens are chosen with the shared logits
processing and drawn from q (:func:`drafter_node.lm_drafter.pick_token`), so sampling is lossless.
"""

from __future__ import annotations

import torch

from drafter_node.base import Capabilities, Drafter, DraftSession, DraftToken
from drafter_node.lm_drafter import pick_token
from drafter_node.settings import DrafterConfig
from shared.checkpoint import read_tensors, weight_map
from shared.models import DTYPES, ProfileSpec, load_causal_lm, load_tokenizer, model_dtype, resolve_model, tokenizer_id
from shared.sampling import GenerationParams

ASSISTANT_MODEL_TYPE = "gemma4_assistant"


class MTPDrafterError(ValueError):
    """The assistant checkpoint and the target do not fit together (the message names the config key)."""


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_layers_for(target_config, assistant_config) -> dict[str, int]:
    """``{layer_type: target layer index}`` whose K/V the assistant attends to; raises :class:`MTPDrafterError` when
    the target does not provide them or their shapes differ from what the assistant expects."""
    if getattr(assistant_config, "model_type", None) != ASSISTANT_MODEL_TYPE:
        raise MTPDrafterError(
            f"drafter.model: a {getattr(assistant_config, 'model_type', '?')!r} checkpoint is not a Gemma 4 assistant "
            f"(mtp_drafter needs a Gemma4AssistantForCausalLM checkpoint, model_type {ASSISTANT_MODEL_TYPE!r})"
        )
    target = _text_config(target_config)
    assistant = _text_config(assistant_config)
    target_type = getattr(target_config, "model_type", "?")
    try:
        modes = list(target.kv_sharing_modes)
        layer_types = list(target.layer_types)
    except (AttributeError, TypeError, ValueError):
        raise MTPDrafterError(
            f"verifier.model: the target ({target_type}) provides no shared K/V states; mtp_drafter needs a Gemma 4 "
            "target (Gemma4ForCausalLM / Gemma4ForConditionalGeneration) whose layers store K/V for an assistant"
        ) from None
    stores = {layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    if not stores:  # no KV sharing in the target: the last layer of each type holds what an assistant reads
        stores = {t: max(i for i, u in enumerate(layer_types) if u == t) for t in set(layer_types)}
    if assistant_config.backbone_hidden_size != target.hidden_size:
        raise MTPDrafterError(
            "drafter.model: the assistant was trained for a target of hidden size "
            f"{assistant_config.backbone_hidden_size}, the target has {target.hidden_size}"
        )
    if assistant.vocab_size != target.vocab_size:
        raise MTPDrafterError(f"drafter.model: vocabulary {assistant.vocab_size} != the target's {target.vocab_size}")
    needed: dict[str, int] = {}
    for a_index, layer_type in enumerate(assistant.layer_types):
        if layer_type not in stores:
            raise MTPDrafterError(
                f"verifier.model: the assistant attends to {layer_type} K/V, which no layer of the target stores"
            )
        t_index = stores[layer_type]
        theirs, ours = target.per_layer_config[t_index], assistant.per_layer_config[a_index]
        for key in ("head_dim", "num_key_value_heads"):
            if getattr(theirs, key) != getattr(ours, key):
                raise MTPDrafterError(
                    f"drafter.model: assistant layer {a_index} ({layer_type}) expects {key}={getattr(ours, key)}, "
                    f"target layer {t_index} has {getattr(theirs, key)}"
                )
        needed[layer_type] = t_index
    return needed


def load_target_embeddings(path: str, target_config, device: str, dtype: str) -> torch.nn.Module:
    """The target's (scaled) input embedding, built alone and filled from the one tensor of the checkpoint that holds
    it: no other target weight is read."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    text = _text_config(target_config)
    files = weight_map(path)
    if files is None:
        raise MTPDrafterError(f"drafter.target_model: {path!r} has no safetensors weights to read the embeddings from")
    found = [k for k in sorted(files) if k.endswith("embed_tokens.weight") and "per_layer" not in k
             and not any(part in k for part in ("vision", "audio"))]
    if len(found) != 1:
        raise MTPDrafterError(f"drafter.target_model: cannot tell the input embedding of {path!r} (found {found})")
    weight = read_tensors(path, files, found)[found[0]]
    if tuple(weight.shape) != (text.vocab_size, text.hidden_size):
        raise MTPDrafterError(f"drafter.target_model: {found[0]} has shape {list(weight.shape)}")
    embed = Gemma4TextScaledWordEmbedding(text.vocab_size, text.hidden_size, text.pad_token_id,
                                          embed_scale=text.hidden_size**0.5)
    with torch.no_grad():
        embed.weight.copy_(weight)
    return embed.to(device=device, dtype=DTYPES[dtype]).eval()


class AssistantMTPDrafter(Drafter):
    type_name = "mtp_drafter"

    def __init__(self, settings: DrafterConfig, own: None = None,
                 profile: ProfileSpec | None = None):  # no causal LM: no profile
        from transformers import AutoConfig

        assistant_path = resolve_model(settings.model)
        target_path = resolve_model(settings.target_model or settings.model)
        target_config = AutoConfig.from_pretrained(target_path)
        self.kv_layers = kv_layers_for(target_config, AutoConfig.from_pretrained(assistant_path))
        self.tokenizer = load_tokenizer(target_path)  # an -assistant checkpoint need not carry a tokenizer
        self.tokenizer_id = tokenizer_id(self.tokenizer)
        self.model = load_causal_lm(assistant_path, settings.device, settings.dtype, settings.max_memory)
        self.embed = load_target_embeddings(target_path, target_config, settings.device, model_dtype(self.model))
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.sliding_window = _text_config(self.model.config).sliding_window
        self.q_top_m = settings.q_top_k
        self.capabilities = Capabilities(sends_q=True, greedy_q=True, needs_hidden_states=True,
                                         needs_kv_layers=sorted(self.kv_layers.values()))
        self.target_vocab_size = _text_config(target_config).vocab_size

    def keep_rows(self, layer_type: str) -> int | None:
        """Rows worth keeping per layer: all for full attention; for sliding layers a margin over the window
        (transformers' assistant mask reads the last window + 1 rows)."""
        return 2 * self.sliding_window if layer_type == "sliding_attention" else None

    @torch.inference_mode()
    def step(
        self, token: int, hidden: torch.Tensor, position: int, kv: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One assistant step: float32 logits for the next token and the projected hidden state to feed back."""
        emb = self.embed(torch.tensor([[token]], device=self.device))
        inputs = torch.cat([emb, hidden.view(1, 1, -1)], dim=-1)
        shared = {t: (rows[0][None], rows[1][None]) for t, rows in kv.items()}
        out = self.model(inputs_embeds=inputs, position_ids=torch.tensor([[position]], device=self.device),
                         shared_kv_states=shared)
        return out.logits[0, -1].float(), out.last_hidden_state[0, -1]

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        return MTPDraftSession(self, token_ids, prompt_len, params, extras)


class MTPDraftSession(DraftSession):
    """One request: the target's K/V rows of the needed layers and its last hidden state, plus the chain."""

    def __init__(self, drafter: AssistantMTPDrafter, token_ids: list[int], prompt_len: int, params: GenerationParams,
                 extras: dict[str, torch.Tensor]):
        super().__init__(token_ids, prompt_len, params)
        self.d = drafter
        # Per layer type: K/V rows [2, kv_heads, n, head_dim] of positions [kv_start, kv_end); complete when kv_end is
        # the committed length − 1 (the verifier's cache holds the same positions: all but the pending token).
        self.kv: dict[str, torch.Tensor | None] = dict.fromkeys(drafter.kv_layers)
        self.kv_start: dict[str, int] = dict.fromkeys(drafter.kv_layers, 0)
        self.kv_end: dict[str, int] = dict.fromkeys(drafter.kv_layers, 0)
        self.hidden: torch.Tensor | None = None  # the target's last hidden state at position hidden_at
        self.hidden_at = -1
        self.cursors: list[tuple[int, torch.Tensor, int]] = []  # per chain token: (token, hidden after it, position)
        self._absorb(extras, len(token_ids) - 1)

    # ------------------------------------------------------------------ target state
    def _absorb(self, extras: dict[str, torch.Tensor] | None, end: int) -> None:
        """Take state rows that end at position ``end`` (exclusive): append each layer's rows to its copy."""
        extras = extras or {}
        hidden = extras.get("hidden")
        if hidden is not None and len(hidden):
            self.hidden, self.hidden_at = hidden[-1].to(self.d.device, self.d.dtype), end - 1
        for layer_type, index in self.d.kv_layers.items():
            new = extras.get(f"kv.{index}")
            if new is None or not new.shape[2]:
                continue
            new = new.to(self.d.device, self.d.dtype)
            old = self.kv[layer_type]
            first_new = end - new.shape[2]
            if old is not None and self.kv_start[layer_type] <= first_new < self.kv_end[layer_type]:
                # Rows past the new rows' start are never used (cannot happen with the verifier's ordered stream,
                # which sends committed rows only: kept for safety).
                old = old[:, :, : first_new - self.kv_start[layer_type]]
                self.kv_end[layer_type] = first_new
            if old is None or self.kv_end[layer_type] != first_new:  # not contiguous: restart from these
                rows, first = new, end - new.shape[2]
            else:
                rows, first = torch.cat([old, new], dim=2), self.kv_start[layer_type]
            keep = self.d.keep_rows(layer_type)
            if keep is not None and rows.shape[2] > keep:
                first += rows.shape[2] - keep
                rows = rows[:, :, -keep:]
            self.kv[layer_type], self.kv_start[layer_type], self.kv_end[layer_type] = rows, first, end

    def observe_state(self, extras: dict[str, torch.Tensor], end: int) -> None:
        self._absorb(extras, end)

    def ready(self) -> bool:
        """The copy covers what the assistant reads at the committed prefix: the hidden state before the pending
        token, every committed position but the pending one for full attention, the window for sliding layers (a
        drafter that joined mid-request, or state dropped for size, leaves it incomplete: the session then waits)."""
        end = len(self.committed) - 1
        if self.hidden is None or self.hidden_at != end - 1:
            return False
        for layer_type, rows in self.kv.items():
            if rows is None or self.kv_end[layer_type] != end:
                return False
            if self.kv_start[layer_type] != 0 and (
                self.d.keep_rows(layer_type) is None or rows.shape[2] < self.d.sliding_window - 1
            ):
                return False
        return True

    # ------------------------------------------------------------------ drafting
    def propose(self, n: int) -> int:
        added = 0
        while added < n and not self.ended:
            if self.cursors:
                token, hidden, position = self.cursors[-1]
            elif self.ready():
                # A fresh anchor: the last committed token, the target's hidden state before it, its position.
                token, hidden, position = self.committed[-1], self.hidden, len(self.committed) - 1
            else:
                break  # no target state for this request yet: nothing to propose
            logits, new_hidden = self.d.step(token, hidden, position, self.kv)
            ids = self.committed + self.chain_tokens
            draft: DraftToken = pick_token(logits, ids, self.params, self.prompt_len, self.d.target_vocab_size,
                                           self.d.q_top_m, self.want_q)
            self.chain.append(draft)
            self.cursors.append((draft.token, new_hidden, position))
            added += 1
        return added

    def observe_commit(self, tokens: list[int], extras: dict[str, torch.Tensor] | None = None) -> int:
        matched = super().observe_commit(tokens, extras)
        # A hit keeps the chain drafted past the commit (and the assistant states it continues from); a miss re-anchors
        # the next block on the target's fresh hidden state.
        self.cursors = self.cursors[len(tokens):] if matched == len(tokens) else []
        self._absorb(extras, len(self.committed) - 1)
        return matched

    def rollback(self, keep: int) -> None:
        super().rollback(keep)
        self.cursors = self.cursors[:keep]
