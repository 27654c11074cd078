"""Scenario generation and fuzz campaigns over :mod:`differential`."""
