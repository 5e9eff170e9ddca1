"""The embedded inference runtime: model import, the torch backend, the continuous-batching engine."""
