"""rapo_ray: Ray-native RAPO (Retrieval-Augmented Policy Optimization) for tool-using LLM agents."""

__version__ = "0.1.0"
