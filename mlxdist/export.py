"""The public name `mlxdist.export` and its entry point `python -m mlxdist.export`; the code is `mlxdist/commands/export.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import export

if __name__ == "__main__":
    sys.exit(export.main())

sys.modules[__name__] = export
