"""Test utilities for mcore and for third-party backend plugins (the harness and the conformance kit)."""
