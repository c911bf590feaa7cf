"""Integrations of ringseq with other libraries.

``ringseq.integrations.transformers`` registers ring attention with HuggingFace transformers
(an optional dependency: ``pip install ringseq[hf]``). Importing this package imports nothing
from transformers; only importing that submodule does.
"""
