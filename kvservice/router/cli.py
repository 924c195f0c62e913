"""`kvservice route`: the flags, then the router until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvservice.argparsing import Parser
from kvservice.router.app import Router
from kvservice.router.backends import parse_backend
from kvservice.router.settings import RouterSettings
from kvservice.settings import add_arguments, from_args

logger = logging.getLogger(__name__)


def _backend(text: str):
    try:
        return parse_backend(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvservice route", description="An OpenAI-compatible front door for a fleet of stock vLLM "
                    "servers: each request goes to the engine with the lowest estimated time to first token, from "
                    "the allocator's Lookup (the engines' KV events, the stores) and the engines' load.")
    parser.add_argument("--backend", type=_backend, action="append", default=[], metavar="NAME=URL[,pool=ID,...]",
                        help="an engine: NAME=URL[,pool=ID][,node=STORE][,role=both|prefill|decode]"
                             "[,connector=BOOL][,events=EP][,replay=EP][,block_size=N]; repeat per engine")
    add_arguments(parser, RouterSettings)
    parser.add_argument("--log-level", default="INFO")
    return parser


def settings_from_argv(argv: list[str] | None) -> RouterSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.backend and not args.backends_file:
        parser.error("name the engines: --backend NAME=URL,pool=ID (repeat) or --backends-file FILE")
    try:
        return from_args(RouterSettings, args, backends=args.backend)
    except ValueError as exc:
        parser.error(str(exc))


async def run(settings: RouterSettings) -> None:
    """Runs the router until SIGTERM or SIGINT."""
    router = Router(settings)
    url = await router.start()
    up = ", ".join(sorted(e.backend.name for e in router.fleet.up())) or "none yet"
    print(f"kvservice route: {url} ({settings.policy}; engines up: {up})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_argv(argv)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
