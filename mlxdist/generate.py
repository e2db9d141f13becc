"""The public name `mlxdist.generate` and its entry point `python -m mlxdist.generate`; the code is `mlxdist/commands/generate.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import generate

if __name__ == "__main__":
    sys.exit(generate.main())

sys.modules[__name__] = generate
