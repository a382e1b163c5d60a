"""Grammar-constrained decoding: JSON schema, regex, choice and grammar outputs.

backend.py (the interface), llguidance_backend.py (default), xgrammar_backend.py,
manager.py (compile in a worker thread, cached; one matcher per sequence),
bitmask.py (apply a step's token bitmask to the logits).
"""

from pagedserve.config import DEFAULT_STRUCTURED_OUTPUT_BACKEND as DEFAULT_BACKEND
from pagedserve.structured_outputs.backend import GrammarError
from pagedserve.structured_outputs.manager import (
    BACKENDS,
    RequestGrammar,
    StructuredOutputManager,
)

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "GrammarError", "RequestGrammar", "StructuredOutputManager"]
