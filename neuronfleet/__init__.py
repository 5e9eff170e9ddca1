"""neuronfleet: Kubernetes operator and embedded inference runtime for LLM fleets on AWS Neuron."""

__version__ = "0.1.0"
