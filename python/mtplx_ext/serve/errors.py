"""The API's errors: what a client did wrong is a 400 naming the field, never a 500.

Every handler raises `BadRequest` before anything reaches the engine; the
routes turn it into OpenAI's error JSON with `error_response`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class BadRequest(Exception):
    """A request the API refuses (never reaches the engine): status 400, or 413 for a body over the limit."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status

    def response(self) -> JSONResponse:
        """The refusal as OpenAI's error JSON."""
        return error_response(self.status, str(self), param=self.param)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI-style error JSON (text from the request, lone surrogates included, is escaped, never a 500)."""
    message, param = _text(message), None if param is None else _text(param)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _text(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


#: Anthropic's error type of each status this server answers with.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "request_too_large", 500: "api_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    """Anthropic-style error JSON (`{"type": "error", "error": {"type", "message"}}`)."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": _text(message)}}, status_code=status)


__all__ = ["ANTHROPIC_TYPES", "BadRequest", "anthropic_error", "error_response"]
