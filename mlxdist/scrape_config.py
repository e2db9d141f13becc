"""The public name `mlxdist.scrape_config` and its entry point `python -m mlxdist.scrape_config`; the code is `mlxdist/commands/scrape_config.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .commands import scrape_config

if __name__ == "__main__":
    sys.exit(scrape_config.main())

sys.modules[__name__] = scrape_config
