"""The tiny byte-level tokenizer and the sharded safetensors layout every family's tiny-checkpoint
writer (testing/tiny/<family>.py) shares: built offline and deterministically (byte-level BPE with merges
learnt by a fixed procedure from a built-in text), for tests, benches and local experiments."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

_NUM_MERGES = 64

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
Once upon a time there was a little model that wanted to learn how to count and how to add numbers.
It read the same sentences again and again, and then it answered the questions in the right order.
Question: what is 12 + 30? Answer: 12 + 30 = 42. Question: what is 7 * 8? Answer: 7 * 8 = 56.
1 + 1 = 2, 2 + 2 = 4, 3 + 3 = 6, 4 + 4 = 8, 5 + 5 = 10, 10 + 10 = 20, 100 - 1 = 99, 9 * 9 = 81.
Hello, world! How are you today? I am fine, thank you. The weather is nice and the sun is shining.
"""


def _learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on `text`, deterministic: the most frequent pair wins, ties go to the
    lexicographically smallest pair."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(text))
    split = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = split[word]
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word, symbols in split.items():
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            split[word] = merged
    return merges


def build_byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer: the 256-symbol ByteLevel alphabet, `_NUM_MERGES`
    merges learnt from a built-in English/arithmetic text, then `SPECIAL_TOKENS` as special tokens.
    `<|endoftext|>` is eos and pad, `<|MASK|>` the mask token. Round-trips any UTF-8 text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    merges = _learn_merges(_CORPUS, _NUM_MERGES)
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = _CHAT_TEMPLATE
    return hf_tok


def write_tokenizer(hf_tok: transformers.PreTrainedTokenizerFast, path: Path, model_max_length: int) -> None:
    """Write `tokenizer.json` and a self-contained `tokenizer_config.json` (chat template inline)."""
    hf_tok.backend_tokenizer.save(str(path / "tokenizer.json"))
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(hf_tok.added_tokens_decoder.items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|MASK|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": hf_tok.chat_template or _CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def reshard(path: Path, num_shards: int) -> None:
    """Split `model.safetensors` into `num_shards` files named and indexed like `save_pretrained`."""
    single = path / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        keys = f.keys()
        tensors = {name: f.get_tensor(name) for name in keys}
        metadata = f.metadata()
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(names)} tensors of the model")
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total_size = sum(sizes)
    # Contiguous groups of roughly equal bytes, in file order; no shard is left empty.
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    running, shard = 0, 0
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        if i:
            by_bytes = min(running * num_shards // total_size, num_shards - 1)
            target = max(by_bytes, num_shards - (len(names) - i))  # one tensor left per later shard
            shard = min(max(target, shard), shard + 1)  # never go back, never skip a shard
        groups[shard].append(name)
        running += size
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(path / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    total_parameters = sum(t.numel() for t in tensors.values())
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    single.unlink()
