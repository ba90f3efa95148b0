"""Releases: package an artifact with its validation report and model card, and verify a release.
Imports convert, runtime.validation (the report format) and the shared helpers."""
