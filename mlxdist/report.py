"""The public name `mlxdist.report` and its entry point `python -m mlxdist.report`; the code is `mlxdist/commands/report.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import report

if __name__ == "__main__":
    sys.exit(report.main())

sys.modules[__name__] = report
