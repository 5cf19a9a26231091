"""A thin HF-like wrapper around a ``tokenizers`` tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as _Tokenizer

from moeflow.errors import CheckpointError


class Tokenizer:
    def __init__(self, path: Path):
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception on bad files
            raise CheckpointError(f"cannot read tokenizer {path}: {e}") from e
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` as one vocabulary entry (e.g. a special token), or None when it is not one."""
        return self._tok.token_to_id(token)

    def special_token_ids(self) -> set[int]:
        """The ids of the added tokens marked special (what ``decode`` drops by default)."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> list[int] | str:
        """The checkpoint's chat template applied to ``messages`` (transformers' semantics): ids, or the text."""
        from moeflow.chat.template import chat_template_for

        text = chat_template_for(self.path.parent).render(messages, add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __call__(self, texts: str | list[str], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Encode one text or a batch, left-padded (as generation wants): input_ids and attention_mask [B, T]."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        encoded = [self.encode(t) for t in batch]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(encoded):
            if e:
                ids[i, width - len(e):] = torch.tensor(e)
                mask[i, width - len(e):] = 1
        return {"input_ids": ids, "attention_mask": mask}
