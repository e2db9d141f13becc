"""Tiny real Hugging Face artifacts for tests: a byte-level BPE tokenizer with a ChatML
template, and a 2-layer Llama and GPT-2 saved with `save_pretrained` (what a user's model dir holds)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The capital of France is Paris.", "What is two plus two? Four.",
          "You are a helpful assistant.", "Hello, how are you today? I am fine, thanks."] * 4


def make_tokenizer(out: Path):
    """A real `PreTrainedTokenizerFast` (byte-level BPE, ChatML), saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHATML
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return tok


def make_llama(out: Path, vocab_size: int = 320, seed: int = 0, tokenizer: bool = True) -> Path:
    """A 2-layer Llama in fp32, random weights, in `out` (config + safetensors [+ tokenizer])."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # norms away from 1 so that training them shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    conf = json.loads((out / "config.json").read_text())
    conf.setdefault("rope_theta", 10000.0)  # mlx-lm reads the top-level key only
    (out / "config.json").write_text(json.dumps(conf))
    if tokenizer:
        make_tokenizer(out)
    return out


def make_gpt2(out: Path, vocab_size: int = 320, seed: int = 0) -> Path:
    """A 2-layer GPT-2 in fp32 (learned positions, tied head, dropout 0), random weights, with the
    tokenizer, in `out`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).float().save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)
    return out
