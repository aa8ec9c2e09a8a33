"""``python -m pipeopt`` and the ``pipeopt`` command: the command line, with Ctrl-C while it
still loads (pydantic, numpy, OR-Tools take a while) answered as at any other time."""

from __future__ import annotations

import signal
import sys
from typing import Any


def run() -> None:
    """Load the command line and run it; exit 130 on Ctrl-C at any point."""
    pressed: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        pressed.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        from pipeopt.cli import main
    except KeyboardInterrupt:
        _interrupted()
    except ImportError:
        if pressed:  # Ctrl-C inside a C extension's initialisation surfaces as ImportError
            _interrupted()
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.exit(main())


def _interrupted() -> None:
    sys.stderr.write("pipeopt: interrupted\n")
    sys.exit(130)


if __name__ == "__main__":
    run()
