"""Random-init checkpoints written like real ones (config + safetensors via `save_pretrained`): what the
demo, the benchmark and the tests load, since these machines have no model hub.

    save_random_model("LlamaConfig", "LlamaForCausalLM", {...shape}, DIR) -> DIR loads like any checkpoint
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
