"""The project's errors: one base, and one subclass for "the caller asked for something wrong".

What to do with an error depends on whose fault it is, not on which module raised it:

- `UserError`: a request, flag, file or config asks for something that cannot be done as asked; its message
  says what, to the person who can change it. The HTTP server answers 4xx with the message; the CLI exits 2.
- any other `MoeServeError`: moeserve could not do what it should have been able to (a kernel that does not
  build, a checkpoint that fails its hashes). The server answers 500 and logs it.
- anything else, a bare ValueError included, is a bug: 500, logged with its traceback; never blamed on the
  caller.

`UserError` is a ValueError as well, so that `except ValueError` written before it still catches it.
Top-level, importing nothing of moeserve, so that every part (runtime included) may raise them.
"""

from __future__ import annotations


class MoeServeError(Exception):
    """Any error moeserve raises on purpose, with a message meant for a person."""


class UserError(MoeServeError, ValueError):
    """The caller asked for something that cannot be done as asked: HTTP 4xx, CLI exit status 2."""


class HFError(UserError):
    """A Hugging Face config.json or tensor set that cannot be read as it is (hf_*.py); the message names the file."""
