"""What `worker.LLM` refuses (clearly, before starting anything), string prompts through a tokenizer, and
`kvservice generate` from the shell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_helpers import Reference, save_char_tokenizer, save_model
from worker import LLM, SamplingParams
from worker.hf.arch import UnsupportedModelError, load_model_spec

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_model("llama", tmp_path_factory.mktemp("llama"), seed=3)
    save_char_tokenizer(path)
    return path


def edited_config(path: Path, tmp_path: Path, **fields) -> Path:
    """A copy of the checkpoint's config.json (no weights: LLM refuses from the config alone)."""
    config = {**json.loads((path / "config.json").read_text()), **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_group_layout_of_each_family(tmp_path):
    gemma = load_model_spec(save_model("gemma3", tmp_path / "g"))
    assert gemma.layer_groups == (1, 0) and gemma.sliding_windows == (None, 24)  # full group first
    mistral = load_model_spec(save_model("mistral", tmp_path / "m"))
    assert mistral.layer_groups == (0, 0) and mistral.sliding_windows == (24,)
    assert load_model_spec(save_model("qwen3", tmp_path / "q")).sliding_windows == (None,)


@pytest.mark.parametrize("fields, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types=\\['chunked_attention'\\]"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"dtype": "int8"}, "dtype='int8'"),
])
def test_unsupported_config_fields_are_refused(llama, tmp_path, fields, message):
    base = save_model("gemma3", tmp_path / "gemma") if "attn_logit_softcapping" in fields else llama
    if "layer_types" in fields or "use_bidirectional_attention" in fields:
        base = save_model("qwen2", tmp_path / "qwen2")
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(edited_config(base, tmp_path, **fields))


def test_bad_prompts_name_the_prompt(llama, server):
    with LLM(llama, allocator=server.target, num_blocks=16, max_model_len=256) as llm:
        with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty list of token ids in \[0, vocab_size"):
            llm.generate([[1, 2], [3, 999]])
        with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
            llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
        with pytest.raises(RuntimeError, match="does not fit pool .* even alone: 15 blocks"):
            llm.generate([[5] * 200], SamplingParams(max_tokens=50, ignore_eos=True))


def test_string_prompts_through_the_tokenizer(llama, server):
    with LLM(llama, allocator=server.target, num_blocks=32, max_model_len=256) as llm:
        [out] = llm.generate("the quick brown fox", SamplingParams(max_tokens=8, ignore_eos=True))
        ids = llm.tokenizer("the quick brown fox").input_ids
    assert out.prompt == "the quick brown fox" and out.prompt_token_ids == ids
    completion = out.outputs[0]
    assert completion.token_ids == Reference(llama).generate(ids, 8)[:len(completion.token_ids)]
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_kvservice_generate_cli(llama, server):
    prompt = [40, 41, 42, 43, 44, 45, 46]
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", "generate", "--model", str(llama), "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-tokens", "5", "--allocator", server.target,
                          "--num-blocks", "16", "--max-model-len", "256"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = Reference(llama).generate(prompt, 5)
    assert f"output 0: token_ids {','.join(map(str, expected))}" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "kvservice.cli", "generate", "--model", "/nonexistent",
                          "--prompt-ids", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no config.json" in bad.stderr
