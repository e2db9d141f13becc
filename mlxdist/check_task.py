"""The public name `mlxdist.check_task` and its entry point `python -m mlxdist.check_task`; the code is `mlxdist/commands/check_task.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import check_task

if __name__ == "__main__":
    sys.exit(check_task.main())

sys.modules[__name__] = check_task
