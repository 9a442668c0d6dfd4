"""Every local task `jattn.data.load` knows: name -> (builder class, default config).

The builders live in their own modules (`builders`: numbers, strings and
digits; `kazemnejad`: Kazemnejad et al.'s lengths; `scan`: SCAN; `chomsky`:
Delétang et al.'s 15 tasks), which build on
`builders.GeneratedBuilder`; this module joins their tables, so none of them
has to import the others back.
"""

from __future__ import annotations

import tensorflow_datasets as tfds

from jattn.data import builders, chomsky, kazemnejad, scan

__all__ = ["BUILDERS"]

BUILDERS: dict[str, tuple[type[tfds.core.GeneratorBasedBuilder], str]] = {
    **builders.BUILDERS,
    **kazemnejad.BUILDERS,
    **scan.BUILDERS,
    **chomsky.BUILDERS,
}
