"""Build verl's PPO critic with sdpa attention where flash-attn is not installed.

verl 0.9.1 loads the critic (``verl.utils.model.load_valuehead_model``) with
``attn_implementation="flash_attention_2"`` written into the call, so ``critic.model.override_config``
cannot change it, and without flash-attn the critic fails to build ("is not a value head model,
please install trl to make it valid"; its trl fallback asks for flash-attn too). gpu_vs_verl.py
names this module in ``VERL_USE_EXTERNAL_MODULES``, which ``import verl`` imports in every verl
process, Ray's workers included (verl's ``critic.model.external_lib`` is imported only where the
config is built, not in the worker that builds the critic): the critic then runs sdpa attention,
as the actor does there (``override_config.attn_implementation=sdpa``). Nothing else changes.
"""

from __future__ import annotations

from transformers import AutoModelForTokenClassification

_load = AutoModelForTokenClassification.from_pretrained.__func__


def _sdpa_for_flash_attention(cls, *args, **kwargs):  # named by gpu_vs_verl.py only without flash-attn
    if kwargs.get("attn_implementation") == "flash_attention_2":
        kwargs["attn_implementation"] = "sdpa"
    return _load(cls, *args, **kwargs)


AutoModelForTokenClassification.from_pretrained = classmethod(_sdpa_for_flash_attention)
