"""``python -m hybridpar ...`` (what torchrun runs: ``torchrun ... -m hybridpar train ...``)."""
import sys

from .cli import main

sys.exit(main())
