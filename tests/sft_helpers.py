"""A tiny Hugging Face chat tokenizer and a few conversations for the SFT tests (tests/finetune/test_sft_data.py)."""

from __future__ import annotations

import json

MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1 + 2?"},
     {"role": "assistant", "content": "3"}],
    [{"role": "user", "content": "def f(x): return x * 2\nf(4)?"}, {"role": "assistant", "content": "8, twice 4"},
     {"role": "user", "content": "and f(5)?"}, {"role": "assistant", "content": "10"}],
    [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello world, hello"}],
]


def chat_tokenizer(directory, template: str | None) -> str:
    """Save a byte-level BPE (vocabulary ~300) as a transformers PreTrainedTokenizerFast directory with the
    chat ``template`` (None: no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + [f"def f{k}(x): return x * {k}" for k in range(50)]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(directory))
    return str(directory)


def write_chats(path, conversations=CONVERSATIONS, repeat: int = 1) -> str:
    with open(path, "w") as fh:
        for _ in range(repeat):
            for c in conversations:
                fh.write(json.dumps({"messages": c}) + "\n")
    return str(path)
