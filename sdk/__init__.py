"""The detour-client distribution: the producer SDK packaged alone (``python -m sdk.build``)."""
