"""Fake kernel families for tests (imported by dotted name: `family_module("fakes.broken")`)."""
