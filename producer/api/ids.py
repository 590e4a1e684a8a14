"""Request ids derived from what the SDK resends, so that a resent submission finds the first one."""

import hashlib


def derived_id(prefix: str, *parts: object) -> str:
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=12).hexdigest()
    return f"{prefix}-{digest}"
