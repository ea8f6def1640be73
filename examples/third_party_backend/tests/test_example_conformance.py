"""Run mcore's conformance suite against this plugin: the whole CI a backend plugin needs."""

from mcore.testing.conformance import BackendConformance


class TestExampleBackendConformance(BackendConformance):
    backend_name = "example"
