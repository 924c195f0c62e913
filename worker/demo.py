"""`kvservice demo` / `make run`: the whole system on this machine in about a minute.

    random-init Llama -> save_pretrained (temp dir) -> LLM: allocator (`kvservice serve`, embedded Redis)
      + one pool of 2 DCP ranks (Ray actors, gloo) -> 64 requests -> transformers.generate on the same dir
Requests share 4 system prompts, some ask n=2, and the pool is small enough that some are preempted;
it prints tokens/s, the prefix hit rate, peak KV usage, preemptions and the match against transformers.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvservice.argparsing import Parser  # noqa: E402
from worker.actor import default_backend  # noqa: E402
from worker.hf.checkpoint import save_char_tokenizer, save_random_model  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

# Llama architecture, random weights: 4 layers, d=256, 8 query / 2 KV heads, vocab 4k.
DEMO_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  initializer_range=0.2)  # wider than the default 0.02: outputs depend on the context


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.choice([64, 96, 128]))] for _ in range(4)]
    return [(systems[i % 4] + [rng.randrange(vocab) for _ in range(rng.randint(8, 40))],
             SamplingParams(max_tokens=rng.randint(8, 24), n=2 if i % 8 == 3 else 1)) for i in range(num_requests)]


def reference_outputs(model_dir: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy `transformers.generate` on the same directory, one prompt at a time (its own attention)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def save_model(directory: str) -> int:
    """`kvservice demo --save-model DIR`: a model dir with a tokenizer, made offline."""
    # bos/eos as the tokenizer has them: text prompts stop at </s> like a real model's would.
    save_random_model("LlamaConfig", "LlamaForCausalLM", {**DEMO_MODEL, "bos_token_id": 1, "eos_token_id": 2},
                      directory)
    save_char_tokenizer(directory, DEMO_MODEL["vocab_size"])
    print(f"kvservice demo: random-init Llama ({DEMO_MODEL['num_hidden_layers']} layers, "
          f"d={DEMO_MODEL['hidden_size']}, vocab {DEMO_MODEL['vocab_size']}) with a character-level tokenizer "
          f"saved to {directory}; try: kvservice generate --model {directory} --prompt \"hello\"")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="kvservice demo", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--backend", choices=["torch", "triton"], default=None,
                        help="attention backend (default: triton with CUDA, the torch twin on CPU)")
    parser.add_argument("--num-blocks", type=int, default=48, help="KV blocks in the pool (small enough that "
                        "some requests are preempted and recomputed)")
    parser.add_argument("--save-model", metavar="DIR", help="only write the demo's random-init Llama with a "
                        "character-level tokenizer to DIR (a model dir `worker.LLM` and `kvservice generate "
                        "--prompt` load), and exit")
    args = parser.parse_args(argv)
    if args.save_model:
        return save_model(args.save_model)
    from worker.llm import LLM

    backend = args.backend or default_backend()
    model_dir = tempfile.mkdtemp(prefix="kvservice-demo-model-")
    try:
        save_random_model("LlamaConfig", "LlamaForCausalLM", DEMO_MODEL, model_dir)
        print(f"kvservice demo: random-init Llama ({DEMO_MODEL['num_hidden_layers']} layers, "
              f"d={DEMO_MODEL['hidden_size']}, vocab {DEMO_MODEL['vocab_size']}) saved to {model_dir}; allocator "
              f"with embedded Redis, one pool of {args.dcp} DCP ranks, attention backend '{backend}'", flush=True)
        requests = workload(args.requests, DEMO_MODEL["vocab_size"])
        with LLM(model_dir, num_blocks=args.num_blocks, dcp=args.dcp, backend=backend, max_model_len=1024,
                 max_num_seqs=32, max_num_batched_tokens=512) as llm:
            print(f"  {len(requests)} requests over 4 shared system prompts, "
                  f"{sum(p.n > 1 for _, p in requests)} of them with n=2", flush=True)
            start = time.perf_counter()
            outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=True)
            elapsed = time.perf_counter() - start
            pool = llm.client.get_stats(check_invariants=True).pools[llm.config.pool_id]
            s, workers_backend, num_blocks = llm.stats, llm.engine.workers.backend, llm.config.num_blocks
        print("  checking every output against transformers.generate ...", flush=True)
        torch.set_num_threads(2)
        expected = reference_outputs(model_dir, [p for p, _ in requests], [sp.max_tokens for _, sp in requests])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    completions = [(c.token_ids, exp) for out, exp in zip(outputs, expected) for c in out.outputs]
    matched = sum(got == exp for got, exp in completions)
    print()
    print(f"  sequences finished       {len(completions)} ({s.forks} forked for n=2, {s.copies} "
          f"copy-on-write block copies)")
    print(f"  tokens/s                 {s.generated_tokens / elapsed:,.1f} generated, "
          f"{s.computed_tokens / elapsed:,.1f} computed ({elapsed:.1f} s, {s.steps} steps)")
    print(f"  prefix hit rate          {s.prefix_hit_rate:.1%} of prompt tokens came from the cache")
    usable = num_blocks - 1
    print(f"  peak KV usage            {s.peak_blocks}/{usable} blocks ({s.peak_blocks / usable:.0%})")
    print(f"  preemptions              {s.preemptions}")
    print(f"  allocator time share     {s.allocator_s / elapsed:.1%} of wall time in Step RPCs")
    print(f"  attention backend        {workers_backend}")
    print(f"  transformers.generate    {matched}/{len(completions)} outputs identical"
          + ("" if matched == len(completions) else "  MISMATCH"))
    print(f"  pool after the run       {pool.num_free_blocks}/{pool.num_blocks - 1} blocks free, invariants "
          f"{'ok' if not pool.invariant_violation else pool.invariant_violation}")
    return 0 if matched == len(completions) and not pool.invariant_violation else 1


if __name__ == "__main__":
    sys.exit(main())
