"""Identifier rules. Ids end up in Redis keys, RQ job ids and HTTP headers, so they are strict."""

import hashlib
import re
import secrets
from typing import Annotated

from pydantic import StringConstraints

# RQ job ids allow only [A-Za-z0-9_-]; the request id *is* the job id.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
# Tinker model ids look like "<session>:train:<n>"; ':' and '.' are allowed, braces and spaces never.
MODEL_ID = r"[A-Za-z0-9_.:-]{1,128}"
MODEL_ID_PATTERN = rf"^{MODEL_ID}$"

# A checkpoint's name (save_state, a named weight sync): a file name under the model's checkpoint directory.
CHECKPOINT_NAME = r"[A-Za-z0-9_.-]{1,128}"
CHECKPOINT_NAME_PATTERN = rf"^{CHECKPOINT_NAME}$"

# A sampled sequence: "<sampling session id>:<seq_id>:<index>", the session's id first.
SEQUENCE_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,200}:[0-9]{1,12}:[0-9]{1,6}$"

RequestId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
_ID_RE = re.compile(ID_PATTERN)
ModelId = Annotated[str, StringConstraints(pattern=MODEL_ID_PATTERN)]


def is_request_id(text: str) -> bool:
    """Whether `text` is an id a producer makes (the request id is the RQ job id)."""
    return _ID_RE.match(text) is not None


def new_request_id(prefix: str = "r") -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def base_model_id(base_model: str) -> str:
    """The queue's model id for samples of a bare base model: it routes them, and no client can create it
    (the SDK's model ids are `<session>:train:<n>`)."""
    return "base:" + hashlib.blake2b(base_model.encode(), digest_size=8).hexdigest()


def losses_model_id(session_id: str) -> str:
    """The queue's model id under which a session's custom losses are created (it routes them)."""
    return f"{session_id}:losses"
