"""Integrations with other tools, apart from the engine: the pytest plugin (fixture ``fa4_audit``)."""
