"""``python -m hybridpar ...`` (what torchrun runs: ``torchrun ... -m hybridpar train ...``)."""
import sys

from .cli.main import main

sys.exit(main())
