"""An ASGI guard that refuses request bodies over the size limit, streamed or not."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.api.http_errors import error_response


class BodyTooLarge(BaseException):
    """Raised inside the app's own body reading; a BaseException so that FastAPI's `except Exception` around
    body parsing (which would answer 400 "error parsing the body") lets it through to this middleware."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body exceeds {self.max_bytes} bytes (TINKERQ_MAX_BODY_BYTES)",
                                  "body_too_large")
        await response(scope, receive, send)
