"""Speculative decoding on the decode side: draft sources, the acceptance rule, adaptive K.

- ``acceptance.py``: the acceptance rule (greedy and exact rejection sampling), maths inline.
- ``verify.py``: target logits of a verify step -> accepted tokens per request.
- ``proposer.py``: the draft-source interface; ``ngram.py`` (prompt lookup) and
  ``model_draft.py`` (k batched draft forwards over the paged layout), the latter shared by
  ``draft_model.py`` (a separate checkpoint, tokenizer checked), ``layer_skip.py`` (the
  target's first layers) and ``quant_self.py`` (a quantized copy of the target); by name in
  ``registry.py``.
- ``adaptive.py``: K per request from its acceptance and measured costs; off when no gain.
- ``decoder.py``: what the engine calls around each step, and the stats.
"""
