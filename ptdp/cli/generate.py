"""``ptdp generate``: continue a prompt with a trained checkpoint, in one process.

A checkpoint of any (t, p, d, v) layout is read as full tensors (``ptdp.checkpointing.full_model``) into a
t = 1 :class:`~ptdp.models.GPTModel`, so generation needs no process group and no GPUs. Decoding is the
plain autoregressive loop: every step runs the model on the whole context (at most
``--max-position-embeddings`` tokens, the saved ``--seq-length`` for checkpoints from before it: a longer
context keeps its last ones) and picks the next token
greedily or by sampling with temperature, top-k and nucleus (top-p) filtering from a seeded generator, so
both modes are reproducible. There is no KV cache: the window slides once the context is full, and
recomputing at most ``seq_length`` positions is cheap for the models this runs on; correctness first.

The tokenizer is the one the run trained with: the first prefix of the saved ``--data-path`` (its
``PREFIX.tokenizer.json`` for BPE), or the byte tokenizer of the default corpus. With ``--chat`` it is the
Hugging Face tokenizer of ``--tokenizer-model`` instead: the conversation is rendered by its chat template as
``ptdp preprocess --sft`` renders training data (``ptdp.data.chat``), and the answer ends at the template's
end-of-turn token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ptdp.config import ConfigError

if TYPE_CHECKING:  # torch loads only when generating, not for `ptdp --help`
    import torch

    from ptdp.data import Tokenizer
    from ptdp.models import GPTModel

TIED_EMBEDDING = "embedding.word_embeddings.weight"  # = ptdp.models.TIED_EMBEDDING


class GenerateError(ConfigError):
    """Bad flags or an unusable checkpoint/tokenizer: one line naming the flag and the fix."""


def generate(model: GPTModel, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], max_new_tokens: int,
             greedy: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, on_token: Callable[[int], None] | None = None,
             stop_ids: Sequence[int] | None = None) -> list[int]:
    """The ids that continue ``prompt_ids``: at most ``max_new_tokens`` of them, ending early with the
    tokenizer's ``eod_id`` (included, as Hugging Face's ``generate`` includes eos; ``tokenizer=None``
    never stops early).

    ``model`` is a full (t = 1) GPTModel; it is put in eval mode (no dropout). Greedy decoding takes the
    arg-max of the real vocabulary (ties go to the lowest id, like ``torch.argmax``); otherwise the
    logits are divided by ``temperature``, cut to the ``top_k`` largest (0 = all) and to the smallest
    set whose probability reaches ``top_p``, and the token is drawn with ``generator`` (same seed, same
    tokens). ``on_token`` is called with each new id as soon as it is chosen (``ptdp generate`` streams).
    ``stop_ids`` (a chat template's end-of-turn ids) replace ``eod_id`` as the ids that end it.
    """
    import torch

    if not prompt_ids:
        raise ValueError("generate: the prompt needs at least one token (use the tokenizer's eod_id)")
    model.eval()
    device = next(model.parameters()).device
    seq_length, vocab = model.cfg.max_position_embeddings or model.cfg.seq_length, model.vocab_size
    stops = set(stop_ids) if stop_ids is not None else {tokenizer.eod_id} if tokenizer is not None else set()
    tokens = [int(i) for i in prompt_ids]
    new: list[int] = []
    with torch.no_grad():
        while len(new) < max_new_tokens:
            context = torch.tensor([tokens[-seq_length:]], dtype=torch.long, device=device)
            logits = model(context)[0, -1, :vocab].float()  # drop the padding ids (already -inf)
            next_id = int(logits.argmax()) if greedy else sample(logits, temperature, top_k, top_p, generator)
            tokens.append(next_id)
            new.append(next_id)
            if on_token is not None:
                on_token(next_id)
            if next_id in stops:
                break
    return new


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> int:
    """One id drawn from ``softmax(logits / temperature)`` after top-k and top-p filtering."""
    import torch

    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p; the most likely one always stays
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.index_put((order[drop],), torch.tensor(float("-inf"), device=logits.device))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


# ------------------------------------------------------------------------------------------------ CLI

def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--load", default=None, help="checkpoint DIR (its `latest`) or one iter_* directory, "
                        "saved in any layout")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="generate at most N tokens (default 64)")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens "
                        "(default 0 = all)")
    parser.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens whose "
                        "probability reaches P (default 1.0 = all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text; "
                        "default: a fresh random seed)")
    parser.add_argument("--tokenizer-prefix", default=None, help="use PREFIX.tokenizer.json (or the byte "
                        "tokenizer when there is none) instead of the checkpoint's --data-path")
    parser.add_argument("--tokenizer-file", default=None, help="use this tokenizer.json (e.g. a Llama "
                        "model's Hugging Face tokenizer; the prompt starts with its BOS token)")
    chat = parser.add_argument_group("chat (docs/sft.md)")
    chat.add_argument("--chat", action="store_true", help="answer a conversation: --prompt is the user's message "
                      "(after --system's), or --messages FILE holds the conversation; rendered with the tokenizer's "
                      "chat template, the answer streamed until the template's end of turn")
    chat.add_argument("--system", default=None, help="with --chat: a system message before --prompt")
    chat.add_argument("--messages", default=None, help="with --chat: a JSON file, a list of {role, content} "
                      "messages or an object with a \"messages\" list (a row of the SFT data)")
    chat.add_argument("--tokenizer-type", default=None, help="with --chat: HuggingFaceTokenizer")
    chat.add_argument("--tokenizer-model", default=None, help="with --chat: the Hugging Face tokenizer DIR that "
                      "holds the chat template")
    chat.add_argument("--chat-template", default=None, help="with --chat: this Jinja template (or JSON with "
                      "\"chat_template\") instead of the tokenizer's")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    """Print the prompt (with ``--chat``: only the answer), then each token as it is produced (a reader sees
    text within a second, not after the whole continuation), then a newline."""
    try:
        generate_text(args, stream=write_stdout)
    except ConfigError as e:  # bad flags, a missing or unusable checkpoint or tokenizer
        print(f"ptdp generate: error: {e}", file=sys.stderr)
        return 2
    write_stdout("\n")
    return 0


class TextStream:
    """Writes a continuation piece by piece: after each token, the part of ``decode(ids so far)`` not yet
    written, holding back trailing U+FFFD (a multi-byte character whose other bytes are still to come), so
    what is written adds up to exactly ``decode(all ids)``."""

    def __init__(self, tokenizer: Tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.written = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        self._emit(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def close(self) -> None:
        self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> None:
        if len(text) > len(self.written) and text.startswith(self.written):
            self.write(text[len(self.written):])
            self.written = text


def generate_text(args: argparse.Namespace, stream: Callable[[str], None] | None = None) -> str:
    """The prompt followed by its continuation, as ``ptdp generate`` prints it (``stream``: also written
    piece by piece as it is produced, the prompt first)."""
    check_arguments(args)
    import torch

    from ptdp.checkpointing import CheckpointError, read_full_model_state
    from ptdp.hf.convert import full_model_from_state

    try:
        tensors, config = read_full_model_state(args.load)
    except CheckpointError as e:
        message = str(e)
        raise GenerateError(message if message.startswith("--load") else f"--load: {message}") from None
    if TIED_EMBEDDING not in tensors:
        raise GenerateError(f"--load {args.load}: the checkpoint holds no model weights; point --load at a "
                            "checkpoint saved by `ptdp train --save` or `ptdp import`")
    model = full_model_from_state(tensors, config)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    if args.chat:
        return answer(args, model, generator, stream)
    tokenizer = checkpoint_tokenizer(config, args.tokenizer_prefix, args.tokenizer_file)
    if tokenizer.vocab_size > model.vocab_size:
        raise GenerateError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's model only "
                            f"{model.vocab_size}; pass the run's --tokenizer-prefix")
    # argv may carry invalid UTF-8 (as lone surrogates): show and encode it as U+FFFD, like the output
    prompt = args.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    prompt_ids = tokenizer.encode(prompt) or [tokenizer.eod_id]
    streamer = TextStream(tokenizer, stream) if stream is not None else None
    if stream is not None:
        stream(prompt)
    new_ids = generate(model, tokenizer, prompt_ids, args.max_new_tokens, generator=generator, on_token=streamer,
                       **_sampling(args))
    if streamer is not None:
        streamer.close()
    return prompt + tokenizer.decode(new_ids)  # eod is not text: both tokenizers skip it


def _sampling(args: argparse.Namespace) -> dict:
    return dict(greedy=args.greedy, temperature=1.0 if args.temperature is None else args.temperature,
                top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p)


def answer(args: argparse.Namespace, model: GPTModel, generator: torch.Generator,
           stream: Callable[[str], None] | None = None) -> str:
    """``--chat``: the answer to the conversation, its prompt rendered as ``ptdp preprocess --sft`` renders
    (``ptdp.data.chat``: ``apply_chat_template(add_generation_prompt=True)``), ended by the template's
    end-of-turn token (not written)."""
    from ptdp.data import DataError
    from ptdp.data.chat import BadRow, check_messages, end_of_turn_ids, generation_prompt, load_chat_tokenizer

    try:
        tok = load_chat_tokenizer(args.tokenizer_model, args.chat_template)
    except DataError as e:
        raise GenerateError(str(e)) from None
    if len(tok) > model.vocab_size:
        raise GenerateError(f"--tokenizer-model {args.tokenizer_model} has {len(tok)} tokens but the checkpoint's "
                            f"model only {model.vocab_size}; give the model's own tokenizer")
    source = f"--messages {args.messages}" if args.messages else "--prompt"
    try:
        prompt_ids = generation_prompt(tok, check_messages(chat_messages(args), need_answer=False))
    except BadRow as e:
        raise GenerateError(f"{source}: {e}") from None
    stops = end_of_turn_ids(tok)
    streamer = TextStream(tok, stream) if stream is not None else None
    new_ids = generate(model, None, prompt_ids, args.max_new_tokens, generator=generator, stop_ids=stops,
                       on_token=None if streamer is None else lambda i: None if i in stops else streamer(i),
                       **_sampling(args))
    if streamer is not None:
        streamer.close()
    return tok.decode([i for i in new_ids if i not in stops])


def chat_messages(args: argparse.Namespace) -> dict:
    """``--chat``'s row: ``{"messages": ...}`` of ``--messages FILE``, or --system's and --prompt's messages."""
    if not args.messages:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return {"messages": [*system, {"role": "user", "content": args.prompt}]}
    try:
        with open(args.messages, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise GenerateError(f"--messages: cannot read {args.messages} ({e.strerror})") from None
    except ValueError as e:
        raise GenerateError(f"--messages {args.messages}: not JSON ({str(e).splitlines()[0]})") from None
    return data if isinstance(data, dict) else {"messages": data}


def _check_chat(args: argparse.Namespace) -> None:
    chat_only = [flag for flag, value in (("--system", args.system), ("--messages", args.messages),
                                          ("--tokenizer-type", args.tokenizer_type),
                                          ("--tokenizer-model", args.tokenizer_model),
                                          ("--chat-template", args.chat_template)) if value is not None]
    if not args.chat:
        if chat_only:
            raise GenerateError(f"{chat_only[0]} applies only with --chat")
        return
    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise GenerateError("--chat renders the model's chat template: give --tokenizer-type HuggingFaceTokenizer "
                            "--tokenizer-model DIR (and --chat-template FILE if DIR has none)")
    if args.tokenizer_prefix or args.tokenizer_file:
        raise GenerateError("--chat reads --tokenizer-model; drop --tokenizer-prefix / --tokenizer-file")
    if args.messages and (args.prompt or args.system is not None):
        raise GenerateError("--messages holds the whole conversation; drop --prompt and --system")
    if not args.messages and not args.prompt:
        raise GenerateError("--chat needs --prompt TEXT (the user's message) or --messages FILE")


def check_arguments(args: argparse.Namespace) -> None:
    if not args.load:
        raise GenerateError("--load is required: give the checkpoint DIR written by `ptdp train --save DIR`")
    _check_chat(args)
    if args.tokenizer_prefix and args.tokenizer_file:
        raise GenerateError("--tokenizer-prefix and --tokenizer-file are exclusive; give one of them")
    if args.max_new_tokens < 0:
        raise GenerateError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    sampling = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                         ("--top-p", args.top_p)) if value is not None]
    if args.greedy and sampling:
        raise GenerateError(f"--greedy and {', '.join(sampling)} are exclusive; drop one of them")
    if args.temperature is not None and not args.temperature > 0:
        raise GenerateError(f"--temperature must be > 0, got {args.temperature}; use --greedy for arg-max")
    if args.top_k is not None and args.top_k < 0:
        raise GenerateError(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")


def checkpoint_tokenizer(config: dict, override: str | None, tokenizer_file: str | None = None) -> Tokenizer:
    """The tokenizer of ``tokenizer_file``, of ``override`` (a prefix) or of the run's first ``--data-path``
    (or ``--train-data-path``) prefix; bytes by default."""
    from ptdp.data import ByteTokenizer, DataError, load_tokenizer
    from ptdp.data.builder import _strip_suffix, parse_data_path
    from ptdp.data.tokenizer import TOKENIZER_SUFFIX, BPETokenizer

    try:
        if tokenizer_file:
            if not os.path.isfile(tokenizer_file):
                raise GenerateError(f"--tokenizer-file {tokenizer_file} does not exist; give a tokenizer.json")
            return BPETokenizer.from_file(tokenizer_file)
        if override:
            return load_tokenizer(_strip_suffix(override))
        data = config.get("data", {})
        if data.get("tokenizer_type"):  # the run's Megatron tokenizer flags
            from ptdp.data.tokenizer_flags import build_tokenizer

            return build_tokenizer(data["tokenizer_type"], data.get("tokenizer_model"), data.get("vocab_file"),
                                   data.get("merge_file"), config.get("model", {}).get("vocab_size"))
        flag = "--data-path" if data.get("data_path") else "--train-data-path"
        data_path = data.get("data_path") or data.get("train_data_path") or []  # the run's training data
        if not data_path:
            return ByteTokenizer()
        prefix = _strip_suffix(parse_data_path(data_path)[0][0])
        if not any(os.path.exists(prefix + suffix) for suffix in (TOKENIZER_SUFFIX, ".idx")):
            raise GenerateError(f"the checkpoint was trained on {flag} {prefix}, which is gone; pass "
                                "--tokenizer-prefix PREFIX (PREFIX.tokenizer.json, or none for bytes)")
        return load_tokenizer(prefix)
    except DataError as e:
        raise GenerateError(str(e)) from None


def write_stdout(text: str) -> None:
    """UTF-8 whatever the locale: the text may hold U+FFFD for bytes that were not valid UTF-8."""
    sys.stdout.flush()
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(text)
    else:
        buffer.write(text.encode("utf-8", "replace"))
    sys.stdout.flush()
