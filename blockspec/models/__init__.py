"""Networks and checkpoint formats: the DFlash, EAGLE-3 and MTP draft models, target loading.

No decoding logic lives here; the drafters that run these networks are in ``blockspec.drafters``.
"""
