"""Speculative decoding on the decode side: draft sources, the acceptance rule, adaptive K.

- ``acceptance.py``: the acceptance rule (greedy and exact rejection sampling), maths inline.
- ``verify.py``: target logits of a verify step -> accepted tokens per request.
- ``proposer.py``: the draft-source interface; ``ngram.py``, ``model_draft.py`` (shared by
  ``draft_model.py``, ``layer_skip.py``, ``quant_self.py``), chosen by ``registry.py``.
- ``adaptive.py``: K per request from its acceptance and measured costs; off when no gain.
- ``decoder.py``: what the engine calls around each step, and the stats.
"""
