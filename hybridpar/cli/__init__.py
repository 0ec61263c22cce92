"""The command line: ``main`` (``hybridpar train`` and the dispatcher), ``plan``
(``hybridpar plan``) and ``weights`` (``import-hf``, ``export``, ``generate``)."""
