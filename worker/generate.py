"""`kvservice generate`: one prompt through `worker.LLM` from the shell.

    kvservice generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N] -> LLM.generate
Prints the generated token ids (and the text when the directory has a tokenizer).
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # LLM spawns `kvservice serve` after using gRPC

import argparse  # noqa: E402
import sys  # noqa: E402

from kvservice.argparsing import Parser  # noqa: E402


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="kvservice generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a directory written by save_pretrained")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (needs a tokenizer in --model)")
    prompt.add_argument("--prompt-ids", type=_ids, help="token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--num-blocks", type=int, help="pool size in blocks (default: from a memory budget)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--backend", choices=["torch", "triton"])
    parser.add_argument("--allocator", metavar="HOST:PORT", help="a running allocator (default: start one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.hf.arch import UnsupportedModelError
    from worker.llm import LLM
    from worker.sampling import SamplingParams
    try:
        params = SamplingParams(max_tokens=args.max_tokens, n=args.n, temperature=args.temperature, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, num_blocks=args.num_blocks, block_size=args.block_size, dcp=args.dcp,
                  backend=args.backend, allocator=args.allocator, max_model_len=args.max_model_len)
    except (FileNotFoundError, UnsupportedModelError, ValueError) as exc:
        print(f"kvservice generate: {exc}", file=sys.stderr)
        return 2
    with llm:
        try:
            [out] = llm.generate([args.prompt if args.prompt is not None else args.prompt_ids], params)
        except ValueError as exc:
            print(f"kvservice generate: {exc}", file=sys.stderr)
            return 2
    print(f"prompt: {len(out.prompt_token_ids)} tokens ({out.num_cached_tokens} cached)")
    for c in out.outputs:
        print(f"output {c.index}: token_ids {','.join(map(str, c.token_ids))} ({c.finish_reason})")
        if c.text:
            print(f"output {c.index}: text {c.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
