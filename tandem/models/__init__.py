"""Models: prepare the default model offline and resolve model names to what engines load.

Cheap to import: torch and transformers are only imported when a conversion actually runs.
"""

from tandem.models.prepare import MODEL_NAME, PrepareError, prepare_model
from tandem.models.resolve import ModelNotFoundError, default_served_name, resolve_model

__all__ = ["MODEL_NAME", "ModelNotFoundError", "PrepareError", "default_served_name", "prepare_model",
           "resolve_model"]
