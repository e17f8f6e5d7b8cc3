"""KV-cache compression inside one request: presses (kvpress semantics) and kvpress as their peer."""
