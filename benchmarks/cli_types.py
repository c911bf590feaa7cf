"""argparse value types shared by the benchmark scripts (no torch import: a script's first line
and its usage errors come before torch loads). Each raises argparse.ArgumentTypeError, so a
bad value is a usage error (exit status 2) naming the option, never a traceback."""
from __future__ import annotations

import argparse
import math
import os
import tempfile


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def positive_float(text):
    """A finite number > 0 (e.g. a peak TFLOP/s)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text}")
    return value


def json_path(text):
    """A path the results can be written to, tried before any work starts (a run should not
    end, minutes later, in a traceback about its output file). Where its folder exists, the
    file is opened for appending (a file this made is removed again); where it does not, the
    nearest folder above it that exists must take a new folder (one of a name of its own is
    made there and removed again); the path's folders are not made (a run refused for another
    argument leaves nothing behind; the results' writer makes them). Ranks of a launcher
    check the same path at once: nothing here removes what another rank made."""
    if str(text).endswith(("/", os.sep)):  # (abspath drops the slash; open would not)
        raise argparse.ArgumentTypeError(f"{text!r} ends in '/': a directory, not a file path")
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file path")
    folder = nearest = os.path.dirname(path)
    while not os.path.lexists(nearest):  # (a dangling link is in the way: refused below)
        nearest = os.path.dirname(nearest)
    if nearest != folder:
        if not os.path.isdir(nearest):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {nearest!r} is not a "
                                             f"folder (a file, or a link to nothing)")
        try:  # (permissions alone do not tell: root may write anywhere but in /proc)
            os.rmdir(tempfile.mkdtemp(prefix=".ringseq-check-", dir=nearest))
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: cannot make folders in "
                                             f"{nearest!r}: {exc.strerror or exc}") from None
        return text
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror or exc}") from None
    if not existed:
        try:
            os.remove(path)
        except FileNotFoundError:  # (another rank of a launcher removed it first)
            pass
    return text


def png_path(text):
    """A writable path ending in ``.png`` (matplotlib writes PNG and adds the suffix to a name
    without one), tried before any work starts as :func:`json_path` does."""
    if not str(text).lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"{text!r} must end in .png (a PNG file path)")
    return json_path(text)


def positive_ints(text):
    """A comma list of positive integers, e.g. ``4096,8192``."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of positive integers, got "
                                         f"{text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be a comma list of positive integers, got "
                                         f"{text!r}")
    return values


def comma_list(valid):
    """A comma list of names, each one of ``valid`` (None: any)."""
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("needs at least one value")
        if valid is not None:
            bad = [x for x in items if x not in valid]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"{', '.join(map(repr, bad))} not among {', '.join(valid)}")
        return items
    return parse
