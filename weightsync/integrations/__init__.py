"""Adapters that plug weightsync into other systems. Each imports its host system lazily:
``import weightsync`` never imports them, and importing one needs only its host installed."""
