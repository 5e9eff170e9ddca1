"""The NeuronModel operator (kopf): resource models, validation, manifest builders and reconcile."""
