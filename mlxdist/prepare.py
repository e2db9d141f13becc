"""The public name `mlxdist.prepare` and its entry point `python -m mlxdist.prepare`; the code is `mlxdist/commands/prepare.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import prepare

if __name__ == "__main__":
    sys.exit(prepare.main())

sys.modules[__name__] = prepare
