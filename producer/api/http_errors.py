"""Error bodies. The SDK retries an empty 400 as a proxy glitch, so every error carries a message."""

from fastapi.responses import JSONResponse

from producer.errors import Rejected


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def error_response(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "code": code, "detail": message}, status_code=status, headers=headers)


def rejected_response(exc: Rejected) -> JSONResponse:
    error = exc.error
    # The SDK retries 409 for minutes with the same body; a conflicting resend is the caller's bug.
    status = 400 if error.status == 409 else error.status
    headers = {"retry-after": "1"} if error.retryable else None
    return error_response(status, error.error, error.code, headers)
