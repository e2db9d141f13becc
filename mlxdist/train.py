"""The public name `mlxdist.train` and its entry point `python -m mlxdist.train`; the code is `mlxdist/commands/train.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import train

if __name__ == "__main__":
    sys.exit(train.main())

sys.modules[__name__] = train
