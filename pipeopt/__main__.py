"""``python -m pipeopt`` and the ``pipeopt`` command: the command line, with Ctrl-C while it
still loads (pydantic, numpy, OR-Tools take a while) answered as at any other time."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def run() -> None:
    """Load the command line and run it; exit 130 on Ctrl-C or SIGTERM at any point."""
    pressed: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        pressed.append(True)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_sigint) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from pipeopt.cli import main
    except KeyboardInterrupt:
        _interrupted()
    except ImportError:
        if pressed:  # Ctrl-C inside a C extension's initialisation surfaces as ImportError
            _interrupted()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = main()
    if code == 130:  # interrupted: what had to be written is written (atomically)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


def _interrupted() -> None:
    """Exit 130 at once. Nothing has been written yet; a normal interpreter shutdown after an
    import cut short by Ctrl-C sometimes ended in a second SIGINT death (-2) instead of 130."""
    sys.stderr.write("pipeopt: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


if __name__ == "__main__":
    run()
