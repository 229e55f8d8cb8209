"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, for every route."""

from typing import Any


class ApiError(Exception):
    """Answered in OpenAI's error shape with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers
        self.param = param  # the request field that is wrong, where one is

    def body(self) -> dict[str, Any]:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.code,
            }
        }
