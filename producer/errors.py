"""Why a submission was refused. Each carries the ErrorResponse an API server should answer."""

from schemas import ErrorResponse


class Rejected(Exception):
    """Nothing was enqueued. `error.status` is the HTTP status to answer with."""

    def __init__(self, error: ErrorResponse) -> None:
        self.error = error
        super().__init__(error.error)

    @classmethod
    def of(cls, status: int, code: str, message: str, retryable: bool = False) -> "Rejected":
        return cls(ErrorResponse(error=message, status=status, code=code, retryable=retryable))
