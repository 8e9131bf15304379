"""Serving the Tinker training API (Thinking Machines' ``tinker`` SDK) with hybridrl, in progress.

This distribution (``hybridrl-tinker``) will serve the API that the SDK's ``ServiceClient`` and
``TrainingClient`` talk to. For now it holds the built-in losses of ``forward_backward`` as pure
functions on the tensors of one datum (:mod:`hybridrl_tinker.losses`); it registers no hooks and has
no entry point. docs/tinker.md says what exists and what does not yet.
"""

__version__ = "0.1.0"
