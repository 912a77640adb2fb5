"""The training harness: models, data, training, records and the `cotangent` command.

Depends on the library (`cotangent`), numpy, tqdm, scipy and matplotlib (the `harness` extra);
the library never imports it. Importing any harness module without the extra raises
`ModuleNotFoundError` naming the missing package and the extra to install. (`audit.py` also runs
as a bare file on the standard library alone, outside the package.)
"""

import importlib.util

from cotangent._entry import HARNESS_PACKAGES

_missing = [name for name in HARNESS_PACKAGES if importlib.util.find_spec(name) is None]
if _missing:
    raise ModuleNotFoundError(
        f"cotangent.harness needs the harness extra ({', '.join(_missing)} not installed): "
        "pip install 'cotangent[harness]'", name=_missing[0])
