"""The error a request gets: raised anywhere in the front end (or a Ray Serve replica), answered by app.py as
an OpenAI-style error body with its status code."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


class HTTPError(Exception):
    def __init__(self, status_code: int, message: str, err_type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status_code, self.message, self.err_type, self.code, self.headers = status_code, message, err_type, code, headers

    def __reduce__(self):  # pickled whole (a Ray Serve replica raises it to the ingress)
        return HTTPError, (self.status_code, self.message, self.err_type, self.code, self.headers)


def model_not_found(model: str, why: str = "") -> HTTPError:
    return HTTPError(404, f"The model `{model}` does not exist.{why}", "not_found_error", "model_not_found")


@contextlib.contextmanager
def combination_part() -> Iterator[None]:
    """Looking up a part of a request's weighted combination (`adapters`): a part that does not exist (or that the
    client may not use: the same 404) is a 400 of the request's `adapters`, as every other refusal of it is."""
    try:
        yield
    except HTTPError as e:
        if e.status_code != 404:
            raise
        raise HTTPError(400, f"`adapters`: {e.message}", code="adapters") from None
