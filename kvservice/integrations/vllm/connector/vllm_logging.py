"""The connector's log lines where vLLM's own go. vLLM configures only its `vllm` logger (`vllm.logger`: its
handler, format and level, not propagated); a `kvservice` logger nobody configured would print warnings bare
(Python's last resort) and drop INFO, such as the worker's start-up line naming its copy path and transport."""

from __future__ import annotations

import logging

OURS = "kvservice"


class ToVllmHandlers(logging.Handler):
    """Hands each record to the `vllm` logger's handlers as they are at that moment: vLLM may configure its
    logging again after the connector is created (dictConfig replaces the handlers)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def follow_vllm_logging() -> bool:
    """Sends the `kvservice` loggers' records to vLLM's handlers, at vLLM's level, unless logging was set up
    otherwise: a handler on the root logger or on any `kvservice` logger (the user's), or none on `vllm`
    (VLLM_CONFIGURE_LOGGING=0). True if it did."""
    ours, vllm = logging.getLogger(OURS), logging.getLogger("vllm")
    if not vllm.handlers or logging.getLogger().handlers or _configured(ours):
        return False
    ours.addHandler(ToVllmHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm.getEffectiveLevel())
    ours.propagate = False  # as vLLM's: a root handler added later would print every line twice
    return True


def _configured(ours: logging.Logger) -> bool:
    if ours.handlers:
        return True
    prefix = OURS + "."
    return any(isinstance(logger, logging.Logger) and logger.handlers
               for name, logger in list(logging.root.manager.loggerDict.items()) if name.startswith(prefix))
