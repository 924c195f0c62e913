"""The CLI reference page, written from the parsers themselves (kvservice.cli.build_parser() and the
parsers `demo`, `generate`, `deploy` and `route` hand their options to), so it cannot drift from the code."""

from __future__ import annotations

import contextlib
import io
import os


def help_text(parser) -> str:
    return parser.format_help().rstrip()


def help_of(entry, name: str) -> str:
    """What `entry(["--help"])` prints: for commands that build their parser inside their main."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        entry(["--help"])
    text = out.getvalue().rstrip()
    if not text:
        raise RuntimeError(f"`kvservice {name} --help` printed nothing")
    return text


def delegated() -> dict[str, object]:
    from kvservice.router.cli import settings_from_argv as route_args
    from worker.demo import main as demo_main
    from worker.deploy.cli import parse_args as deploy_args
    from worker.generate import parse_args as generate_args
    return {"demo": demo_main, "generate": generate_args, "deploy": deploy_args, "route": route_args}


def page() -> str:
    os.environ["COLUMNS"] = "110"  # argparse wraps at the terminal's width: fix it so the page is stable
    from kvservice.cli import build_parser
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    out = ["# Command line (`kvservice`)", "",
           "Generated at build time from `kvservice.cli.build_parser()` and the parsers it hands options to "
           "(`tools/docs/cli_ref.py`): every flag with its default, exactly as `--help` prints it.", "",
           "```text", help_text(parser), "```", ""]
    others = delegated()
    for name, sub in subcommands.items():
        out += [f"## `kvservice {name}`", "", "```text"]
        out.append(help_of(others[name], name) if name in others else help_text(sub))
        out += ["```", ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(page())
