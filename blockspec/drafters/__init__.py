"""The drafter protocol's implementations (DFlash, EAGLE-3/MTP, a draft LM, prompt lookup) and the
one registry that builds them by method name (``blockspec.drafters.registry``)."""
