"""Random-init Hugging Face checkpoints for the tests (no hub): small configs of every supported
architecture, saved with `save_pretrained`, and `transformers.generate` as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.hf.checkpoint import save_char_tokenizer as save_tokenizer
from worker.hf.checkpoint import save_random_model  # worker.hf first: it sets TRITON_INTERPRET

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             # Wider than the default 0.02, so attention is sharp and outputs depend on the context.
             initializer_range=0.2)
SLIDING_WINDOW = 24  # shorter than the test prompts: blocks outside it are freed and reused

ARCHITECTURES = {  # name -> (config class, model class, config fields), classes named in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": SLIDING_WINDOW}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                # Untied: with Gemma's scaled embeddings a tied head mostly repeats the last token.
                "query_pre_attn_scalar": 16, "tie_word_embeddings": False}),
}


def save_model(arch: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """A random-init `arch` model written to `directory` as a checkpoint (config + safetensors)."""
    config_name, model_name, extra = ARCHITECTURES[arch]
    return save_random_model(config_name, model_name, {**SHAPE, **extra, **overrides}, directory, seed)


class Reference:
    """`transformers.generate` on the same directory: its own attention and cache, greedy."""

    def __init__(self, path: Path) -> None:
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                       attn_implementation="eager").eval()

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()


def save_char_tokenizer(directory: Path) -> None:
    """A character-level tokenizer of the model's vocabulary (ids 0..3 special), beside the checkpoint."""
    save_tokenizer(directory, VOCAB)
