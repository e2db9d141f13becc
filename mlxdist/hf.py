"""The public name `mlxdist.hf`; the code is `mlxdist/integrations/hf.py`.

This file only binds the name: importing it gives that very module (one module, two names),
so the root holds the entry points while the code lives with its kind.
"""

import sys

from .integrations import hf

sys.modules[__name__] = hf
