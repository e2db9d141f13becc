"""The public name `mlxdist.plan` and its entry point `python -m mlxdist.plan`; the code is `mlxdist/commands/plan.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import plan

if __name__ == "__main__":
    sys.exit(plan.main())

sys.modules[__name__] = plan
