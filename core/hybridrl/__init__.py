"""hybridrl: reinforcement-learning post-training of LLMs, composed from plugins."""

__version__ = "0.1.0"
