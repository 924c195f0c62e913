"""The engine bench's side-by-side row: the same shared-prefix workload through `worker.LLM` and through
transformers' own batched `generate()` on the same random-init Llama checkpoint.

    checkpoint (save_pretrained) -> LLM.generate (continuous batching, prefix cache, paged KV)
                                 -> AutoModelForCausalLM.generate (one left-padded batch, its DynamicCache)
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

import torch

from worker.demo import DEMO_MODEL
from worker.hf.checkpoint import save_random_model
from worker.sampling import SamplingParams

SYSTEM_LEN = 128


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(SYSTEM_LEN)] for _ in range(4)]
    return [(systems[i % 4] + [rng.randrange(vocab) for _ in range(rng.randint(16, 48))], rng.randint(16, 32))
            for i in range(n)]


def run_llm(model_dir: str, target: str, reqs) -> dict:
    from worker.llm import LLM
    with LLM(model_dir, allocator=target, num_blocks=1024, max_model_len=512, max_num_seqs=64,
             max_num_batched_tokens=2048, backend="torch") as llm:
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in reqs])
        wall = time.perf_counter() - t0
        s = llm.stats
        bytes_per_block = 2 * DEMO_MODEL["num_hidden_layers"] * 16 * DEMO_MODEL["num_key_value_heads"] * \
            DEMO_MODEL["head_dim"] * 4
        return {"wall_s": wall, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "kv_bytes": s.peak_blocks * bytes_per_block, "hit_rate": s.prefix_hit_rate,
                "outputs": [o.outputs[0].token_ids for o in outs]}


def run_transformers(model_dir: str, reqs) -> dict:
    """One left-padded batch to the longest max_tokens (generate cannot stop rows at different lengths)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    longest = max(len(p) for p, _ in reqs)
    ids = torch.zeros((len(reqs), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    max_new = max(m for _, m in reqs)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        wall = time.perf_counter() - t0
    cache = out.past_key_values
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    outputs = [out.sequences[i, longest:longest + m].tolist() for i, (_, m) in enumerate(reqs)]
    return {"wall_s": wall, "tokens": sum(m for _, m in reqs), "kv_bytes": kv_bytes, "outputs": outputs}


def side_by_side(target: str, num_requests: int, reps: int = 3) -> dict:
    """Medians over `reps` runs, the two sides taking turns."""
    reqs = workload(num_requests, DEMO_MODEL["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="kvservice-bench-model-") as model_dir:
        save_random_model("LlamaConfig", "LlamaForCausalLM", DEMO_MODEL, model_dir)
        ours, theirs = [], []
        for _ in range(reps):
            theirs.append(run_transformers(model_dir, reqs))
            ours.append(run_llm(model_dir, target, reqs))
    # Padded rows of the batch see pad positions masked out; equal outputs show the work is the same.
    same = sum(a == b for a, b in zip(ours[-1]["outputs"], theirs[-1]["outputs"]))
    med = {side: {"wall_s": statistics.median(r["wall_s"] for r in runs), "tokens": runs[0]["tokens"],
                  "kv_bytes": runs[0]["kv_bytes"]} for side, runs in (("llm", ours), ("transformers", theirs))}
    for side in med.values():
        side["tokens_per_s"] = side["tokens"] / side["wall_s"]
    return {**med, "ratio": med["llm"]["tokens_per_s"] / med["transformers"]["tokens_per_s"],
            "identical_outputs": same, "requests": num_requests, "hit_rate": ours[0]["hit_rate"]}
