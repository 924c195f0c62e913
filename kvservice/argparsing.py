"""The argument parser of every kvservice command: no abbreviated flags (`--metrics 9000` must not quietly
mean `--metrics-port`), and an unknown flag answered with the command's usage and the closest real flag."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def flags(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def suggest(self, arg: str) -> str | None:
        """The flag `arg` most likely meant ("did you mean"), or None."""
        if not arg.startswith("-"):
            return None
        name = arg.split("=", 1)[0]
        prefixed = [f for f in self.flags() if f.startswith(name)]
        match = prefixed or difflib.get_close_matches(name, self.flags(), n=1, cutoff=0.6)
        return match[0] if match else None

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            hints = [f"{arg.split('=', 1)[0]}: did you mean {flag}?"
                     for arg in message[len(prefix):].split() if (flag := self.suggest(arg))]
            if hints:
                message = f"{message} ({'; '.join(hints)})"
        super().error(message)
