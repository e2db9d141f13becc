"""docs/architecture.md names every product module, so a newcomer finds each one from it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_product_module_is_named_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    product = [p for p in sorted((ROOT / "mlxdist").rglob("*.py"))
               if p.name != "__init__.py" and not {"rig", "bench", "__pycache__"} & set(p.relative_to(ROOT).parts)
               and p.parent != ROOT / "mlxdist" or p.name in ("gate.py", "problems.py", "blas.py", "config.py",
                                                               "markers.py", "errors.py", "torch.py", "mlx.py")]
    missing = [str(p.relative_to(ROOT)) for p in product if not re.search(rf"\b{re.escape(p.name)}", doc)]
    assert not missing, f"docs/architecture.md does not name {missing}"
