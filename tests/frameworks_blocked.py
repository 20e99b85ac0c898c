"""``python tests/frameworks_blocked.py MODULE ARGS...``: run ``MODULE`` as ``__main__``
with torch, TensorFlow and Horovod unimportable (as on a host or image without them).

A meta-path finder placed first refuses those top-level packages (and their submodules)
with :class:`ImportError`, whether or not they are installed, so any import of them by the
module, directly or through a dependency, fails loudly.
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys
from pathlib import Path

BLOCKED = ("torch", "tensorflow", "horovod", "keras")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: this process must run without "
                              f"{', '.join(BLOCKED)}")


if __name__ == "__main__":
    sys.meta_path.insert(0, _Blocker())
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout, not tests/
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
