"""Chat conversations -> token ids and the assistant-token mask, rendered by the model's own chat template.

The rendering is transformers' ``apply_chat_template`` itself (imported lazily: only ``ptdp preprocess --sft``
needs it), so the ids are exactly what the model's tokenizer gives a conversation. The mask -- 1 on the
tokens that carry the loss -- is:

* **generation markers** (a template with ``{% generation %}...{% endgeneration %}``): transformers'
  assistant tokens mask (``return_assistant_tokens_mask=True``), i.e. every token overlapping a span the
  template marks;
* **by role** (a template without markers): each assistant turn is the text the template adds between the
  conversation up to that turn rendered with ``add_generation_prompt=True`` (the prompt for the answer) and
  the conversation up to and including that turn (the answer with its end-of-turn text, so the model learns
  to stop); a token overlapping such a span carries the loss (transformers' overlap rule). A template that
  does not render a conversation as the concatenation of its turns (one that rewrites earlier turns) cannot
  be split this way: one line asking for generation markers.

``ptdp generate --chat`` renders its prompt here too (:func:`generation_prompt`, the template's opening of
the answer) and stops at the template's end-of-turn token (:func:`end_of_turn_ids`).
"""

from __future__ import annotations

import json
import os
import re

from ptdp.data.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for the markers


class BadRow(Exception):
    """A conversation that cannot be used; the message is the reason (the caller names file and row)."""


def load_chat_tokenizer(model: str | None, chat_template: str | None):
    """transformers' fast tokenizer of ``--tokenizer-model`` (a directory or a tokenizer.json) with its chat
    template, or the one in ``--chat-template FILE`` (a Jinja file, or a JSON object with ``chat_template``)."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise DataError("chat templates (--sft, --chat) are rendered by transformers (pip install transformers)") from None
    if not model:
        raise DataError("--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (the model's "
                        "Hugging Face tokenizer)")
    try:
        tok = (AutoTokenizer.from_pretrained(model) if os.path.isdir(model)
               else PreTrainedTokenizerFast(tokenizer_file=model))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        raise DataError(f"--tokenizer-model: cannot load {model} with transformers "
                        f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if chat_template is not None:
        try:
            with open(chat_template, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as err:
            raise DataError(f"--chat-template: cannot read {chat_template} ({err.strerror})") from None
        if chat_template.endswith(".json"):
            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"--chat-template: {chat_template} is JSON without a \"chat_template\" string") \
                    from None
        tok.chat_template = text
    if not isinstance(getattr(tok, "chat_template", None), str) or not tok.chat_template.strip():
        raise DataError(f"--tokenizer-model: the tokenizer at {model} has no chat template (tokenizer_config.json's "
                        "chat_template or chat_template.jinja); give one with --chat-template FILE")
    return tok


def has_generation_markers(template: str) -> bool:
    return GENERATION_MARKER.search(template) is not None


def check_messages(record, need_answer: bool = True) -> list[dict]:
    """The ``messages`` of one parsed row, checked (raises :class:`BadRow`); ``need_answer``: it must hold an
    assistant turn (training data; a prompt to answer need not)."""
    if not isinstance(record, dict):
        raise BadRow("not a JSON object")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRow("no \"messages\" list")
    for k, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message:
            raise BadRow(f"message {k} has no \"role\"")
        if message["role"] not in ROLES:
            raise BadRow(f"message {k} has the unknown role {message['role']!r} (known: {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str):
            raise BadRow(f"message {k} ({message['role']}) has no string \"content\"")
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn (nothing to train on)")
    return messages


def encode_conversation(tok, messages: list[dict], markers: bool) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of one conversation; ids are ``apply_chat_template(messages)``'s."""
    try:
        if markers:
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        else:
            ids, mask = _by_role(tok, messages)
    except BadRow:
        raise
    except Exception as err:  # noqa: BLE001 - a template error (jinja2 raise_exception, ...) on this row
        raise BadRow(f"the chat template fails on it ({str(err).splitlines()[0] if str(err) else type(err).__name__})") \
            from None
    if not any(mask):
        raise BadRow("the chat template marks no assistant token in it")
    return ids, mask


def _by_role(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Assistant spans by diffing the renderings of the conversation's prefixes (module docstring)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        turn = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise BadRow(f"the chat template does not render message {i + 1} as a continuation of the earlier "
                         "turns; add {% generation %} markers to it (--chat-template)")
        spans.append((len(prompt), len(turn)))
    ids = list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids:
        raise BadRow("the tokenizer does not give the template's rendering the same ids as apply_chat_template")
    mask, j = [0] * len(ids), 0
    for t, (start, end) in enumerate(enc["offset_mapping"]):  # transformers' overlap rule, one pass
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        if end > spans[j][0]:
            mask[t] = 1
    return ids, mask


def generation_prompt(tok, messages: list[dict]) -> list[int]:
    """The ids a model answers ``messages`` from: ``apply_chat_template(messages, add_generation_prompt=True)``
    (the conversation, then the template's opening of an assistant turn)."""
    try:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template error on these messages
        raise BadRow(f"the chat template fails on it ({str(err).splitlines()[0] if str(err) else type(err).__name__})") \
            from None
    return list(out["input_ids"])


_PROBE = "\u2063ptdp-answer\u2063"  # a text no template writes itself


def end_of_turn_ids(tok) -> list[int]:
    """The ids that end an answer: the first special token the template writes after an assistant message's
    content (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3, ``<end_of_turn>`` in Gemma), then the
    tokenizer's end-of-sequence token, when it has them."""
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    stops = []
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001 - a template that wants another shape of conversation: eos only
        text = ""
    if _PROBE in text:
        tail = tok(text[text.index(_PROBE) + len(_PROBE):], add_special_tokens=False)["input_ids"]
        stops += [i for i in tail if i in special][:1]
    if tok.eos_token_id is not None and tok.eos_token_id not in stops:
        stops.append(int(tok.eos_token_id))
    return stops
