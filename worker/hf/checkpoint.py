"""Random-init checkpoints written like real ones (config + safetensors via `save_pretrained`): what the
demo, the benchmark and the tests load, since these machines have no model hub.

    save_random_model("LlamaConfig", "LlamaForCausalLM", {...shape}, DIR) -> DIR loads like any checkpoint
    save_char_tokenizer(DIR, vocab_size)    -> a character-level tokenizer beside it (text prompts work)
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_model(config_name: str, model_name: str, fields: dict, directory: str | Path,
                      seed: int = 0) -> Path:
    """`transformers.<model_name>(<config_name>(**fields))` with seeded random weights, saved to `directory`."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    return Path(directory)


def save_char_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """A character-level tokenizer over `vocab_size` ids (0..3: <pad> <s> </s> <unk>, then one printable
    character each from U+0020), saved beside a checkpoint with `save_pretrained`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(c) for c in range(32, 32 + vocab_size - len(specials))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
