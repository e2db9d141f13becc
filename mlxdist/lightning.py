"""The public name `mlxdist.lightning`; the code is `mlxdist/integrations/lightning.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .integrations import lightning

sys.modules[__name__] = lightning
