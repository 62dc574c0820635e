"""Tools for testing and measuring kvflow and what is built on it.

* ``InstrumentedStore(inner)`` (``kvflow.testing.stores``): a ``StoreWrapper`` that counts every
  call and times the copies; subclass it to inject faults. ``CopyRecord``, ``METADATA_CALLS``.
* ``kvflow.testing.models``: a random model and a tokenizer built offline (Llama, Mistral,
  Gemma-2, DeepSeek-V2 with MLA), for an inference server on a machine with no model downloads:
  ``build(directory, family=...)``, or ``python -m kvflow.testing.models DIR``. It needs
  ``transformers`` and is imported on its own, never by this package.
"""

from kvflow.testing.stores import METADATA_CALLS, CopyRecord, InstrumentedStore

__all__ = ["METADATA_CALLS", "CopyRecord", "InstrumentedStore"]
