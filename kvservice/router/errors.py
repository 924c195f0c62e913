"""Errors in vLLM 0.32's shape (`vllm.entrypoints.serve.engine.protocol.ErrorResponse`): `{"error": {"message",
"type", "param", "code"}}`, with vLLM's status, type and message for what the router itself refuses. Whatever
else is wrong with a request, the engine it is forwarded to says so (its reply passes through)."""

from __future__ import annotations

import json
from http import HTTPStatus

from aiohttp import web


class RouterError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}

    def response(self, headers: dict | None = None) -> web.Response:
        return json_reply(self.body(), self.status, headers)


def json_reply(obj, status: int, headers: dict | None = None) -> web.Response:
    """JSON as Starlette's JSONResponse writes it (vLLM's errors): the same bytes and content type."""
    body = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return web.Response(body=body, status=status, headers={**(headers or {}), "Content-Type": "application/json"})


def invalid_json(exc: json.JSONDecodeError) -> RouterError:
    """What FastAPI and vLLM's validation handler answer a body that is not JSON."""
    err = {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error", "input": "<dict of 0 items>",
           "ctx": {"error": exc.msg}}
    return RouterError(400, f"1 validation error:\n  {err}", HTTPStatus.BAD_REQUEST.phrase, f"body.{exc.pos}")


def unknown_model(model: str, served: list[str]) -> RouterError:
    return RouterError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
                       "NotFoundError", "model")


def no_prompt() -> RouterError:
    """`"prompt": []`: an empty batch, to vLLM."""
    return RouterError(400, "You must pass at least one prompt", "BadRequestError")


def empty_prompt() -> RouterError:
    return RouterError(400, "The decoder prompt cannot be empty", "BadRequestError")


def prompt_too_long(num_tokens: int, max_model_len: int) -> RouterError:
    # vLLM says "at least" at one over: its tokenizer may have cut a text prompt there
    qualifier = "at least " if num_tokens == max_model_len + 1 else ""
    return RouterError(400, f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                            f"contains {qualifier}{num_tokens} input tokens, which exceeds this limit even without any "
                            f"output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                            f"value={num_tokens})", "BadRequestError", "input_tokens")


def no_engine(model: str | None) -> RouterError:
    what = f" serving `{model}`" if model else ""
    return RouterError(503, f"No engine{what} is up (kvservice route: every engine is ejected or refused the "
                            f"connection).", "ServiceUnavailableError")


def engine_failed(name: str, exc: BaseException) -> RouterError:
    return RouterError(502, f"kvservice route: engine {name} failed before answering: {type(exc).__name__}: {exc}",
                       "BadGatewayError")


def unauthorized() -> web.Response:
    """vLLM's own answer to a missing or wrong API key (its --api-key middleware)."""
    return json_reply({"error": "Unauthorized"}, 401)
